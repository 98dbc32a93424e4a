"""kvlab.policy.spec: one reader of cache specs, registries instead of lists, and the fp8 codec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.errors import BadInputError
from kvlab.policy.evict import POLICIES
from kvlab.policy.quant.methods import QUANTIZERS, make_quantizer, quantizer_names
from kvlab.policy.spec import FULL, CachePolicy, ScoredLayout, SinksWindowLayout, known, parse, parse_many


@pytest.mark.parametrize(
    ("text", "canonical", "kind"),
    [
        ("full", "full", "full"),
        ("int4", "codec=pertoken4", "quant"),
        ("kivi:int2", "codec=kivi2", "quant"),
        ("snapkv:0.5", "snapkv,keep=0.5", "evict"),
        ("window:0.25", "streaming_llm,keep=0.75", "evict"),
        ("KeyNorm:0.5", "knorm,keep=0.5", "evict"),
        ("sinks=4,window=2048,codec=kivi4", "sinks=4,window=2048,codec=kivi4", "window"),
        ("window=2048", "sinks=4,window=2048", "window"),
        ("h2o,keep=0.25,every=256", "h2o,keep=0.25,every=256", "evict"),
        ("h2o, ratio=0.75, every=256", "h2o,keep=0.25,every=256", "evict"),
        ("codec=fp8", "codec=fp8", "quant"),
        ("sinks=4,rotation4", "sinks=4,codec=rotation4", "quant"),
        ("tova,budget=512,codec=int8,tail=32", "tova,budget=512,codec=pertoken8,tail=32", "evict"),
    ],
)
def test_specs_read_to_one_canonical_policy(text, canonical, kind):
    p = parse(text)
    assert (p.spec, p.kind) == (canonical, kind)
    assert parse(p.spec) == p  # the canonical string names the same policy
    assert p.to_json()["spec"] == canonical


def test_what_a_policy_holds():
    p = parse("sinks=2,window=100,chunk=32,codec=kivi4")
    assert p.layout == SinksWindowLayout(2, 100, 32) and (p.codec, p.bits) == ("kivi", 4) and not p.exact
    assert parse("full") is FULL and FULL.exact and FULL.quantizer() is None
    lay = parse("snapkv,keep=0.5,window=8").layout
    assert isinstance(lay, ScoredLayout) and lay.policy().window == 8 and lay.policy().name == "snapkv"
    q = parse("codec=kivi2,tail=64").quantizer(head_dim=16)
    assert (q.kind, q.bits, q.window, q.group_size) == ("kivi", 2, 64, 16)  # group cut to a small head
    assert p.describe() == "2 sinks + the last 100 slots, in kivi4 codes"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty cache spec"),
        ("bogus", "unknown item 'bogus'"),
        ("h2o", "give one budget"),
        ("h2o,keep=0.5,budget=3", "give one budget"),
        ("h2o,keep=2", r"keep must be a fraction in \(0, 1\]"),
        ("h2o,keep=nan", "keep=nan is not a number"),
        ("h2o,keep=inf", "keep=inf is not a number"),
        ("window=\uff12\uff15\uff16", r"character 8 \('\\uff12'\) is not printable ASCII"),  # fullwidth 256
        ("window=\u0662\u0665", "not printable ASCII"),  # Arabic-Indic digits
        ("sinks=4,window=1_000", "window=1_000 is not an integer"),
        ("window=256\x00", "not printable ASCII"),
        ("window=" + "9" * 100_000, r"is 100,007 characters long \(at most 256\)"),
        ("snapkv:1.0", r"must lie in \[0, 1\)"),
        ("sinks=4", "sinks= alone keeps everything"),
        ("window=0", "window must be >= 1"),
        ("window=99999999999", "must lie in"),
        ("sinks=-1,window=3", "sinks=-1 is not an integer"),
        ("codec=kivi5", "unsupported bit width 5"),
        ("codec=zip4", "unknown codec 'zip4'"),
        ("codec=fp4", "unknown codec"),
        ("tail=3", "add codec="),
        ("sinks=4,window=64,codec=kivi4", "holds none: it needs the eviction chunk \\(32\\)"),
        ("h2o,keep=0.5,chunk=3", "sinks \\+ window only"),
        ("window=10,every=3", "only apply to a score"),
        ("window=10,window=12", "given twice"),
        ("h2o,keep=x", "is not a number"),
        ("color=red", "unknown key 'color'"),
        ("h2o,snapkv,keep=0.5", "unknown item 'snapkv'"),
    ],
)
def test_a_bad_spec_is_one_clear_error(text, message):
    with pytest.raises(BadInputError, match=message) as info:
        parse(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 1000  # one line, never the whole input


def test_errors_name_what_is_known_from_the_registries():
    text = known()
    for name in POLICIES:
        assert name in text
    for kind, cls in QUANTIZERS.items():
        assert (kind if cls.fixed_bits else f"{kind}<bits>") in text
    with pytest.raises(BadInputError, match="twice"):
        parse_many(["int4", "codec=pertoken4"])


def test_a_codec_registers_itself_and_reaches_the_parser():
    assert "fp8" in quantizer_names() and parse("fp8").codec == "fp8"
    with pytest.raises(BadInputError, match="has 8 bits"):
        make_quantizer("fp8", 4)


def test_fp8_error_bound_and_bytes():
    """E4M3 rounds each element to 3 mantissa bits of its group's scale: relative error <= 2^-4 for
    elements above the subnormal range; 1 byte per element plus an fp16 scale per group."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 40, 64, generator=gen) * 5
    v = torch.randn(1, 2, 40, 64, generator=gen)
    seg = make_quantizer("fp8").encode(k, v, torch.arange(40), None)
    dk, dv = seg.decode()
    scale = k.abs().amax(-1, keepdim=True) / 448
    normal = k.abs() >= scale * 2.0**-6  # E4M3's smallest normal, in units of the scale
    assert ((dk - k).abs() <= k.abs() * 2.0**-4 * 1.001)[normal].all()
    assert ((dk - k).abs() <= scale * 2.0**-9 * 1.001 + 1e-30)[~normal].all()
    assert seg.nbytes == 2 * (k.numel() + k.numel() // 64 * 2)
    assert dk.dtype == k.dtype and torch.equal(seg.decode()[0], dk)


@settings(max_examples=60, deadline=None)
@given(
    sinks=st.integers(0, 64),
    window=st.integers(1, 10_000),
    score=st.sampled_from(sorted(POLICIES)),
    keep=st.floats(0.01, 1.0),
    every=st.integers(0, 512),
    codec=st.sampled_from([None, "int4", "kivi2", "fp8", "rotation4"]),
)
def test_canonical_strings_round_trip(sinks, window, score, keep, every, codec):
    c = f",codec={codec}" if codec else ""
    window += 200 if codec else 0  # a window over codes holds its chunk, a block and the codec's tail
    for text in (f"sinks={sinks},window={window}{c}", f"{score},keep={keep!r},every={every}{c}"):
        p = parse(text)
        assert isinstance(p, CachePolicy) and parse(p.spec) == p


def test_the_study_reads_the_registries():
    """A codec or an eviction policy added in one file is measured by the compression experiment."""
    from kvlab.study.experiments.compression import POLICY_NAMES, QUANT_METHODS

    assert set(POLICIES) == set(POLICY_NAMES) and "random_sinks" in POLICY_NAMES
    for name in quantizer_names():
        assert QUANT_METHODS[name] == (name, {}) and QUANT_METHODS[f"{name}+sinks"] == (name, {"sinks": 4})


def test_a_one_file_codec_and_policy_run_in_the_study(smollm, tmp_path):
    from kvlab.study.experiments import ExperimentContext, get_experiment
    from kvlab.study.runner import run_experiment

    ctx = ExperimentContext(
        out_dir=tmp_path,
        profile="quick",
        options=dict(
            context_tokens=96,
            continuation_tokens=16,
            windows=1,
            bits=[4],
            keeps=[0.5],
            methods=["fp8"],
            policies=["random_sinks"],
            needle_lengths=[96],
            needle_depths=[0.5],
            needle_configs=["random_sinks 50%"],
            timing_steps=0,
        ),
    )
    ctx.model_handle = smollm
    configs = run_experiment(get_experiment("compression"), ctx).summary["configs"]
    assert {"full precision", "fp8", "random_sinks 50%"} <= set(configs)
    assert configs["fp8"]["bytes_per_token"] < 0.6 * configs["full precision"]["bytes_per_token"]


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        ("full", "FullCache"),
        ("codec=int4", "CompressedCache"),
        ("sinks=4,window=64", "RollingCache"),
        ("sinks=4,window=96,chunk=32,codec=fp8,tail=16", "RollingCache"),
        ("h2o,keep=0.5,every=8", "CompressedCache"),
        ("snapkv,budget=24,codec=int4", "CompressedCache"),
    ],
)
def test_cache_for_builds_the_live_cache_a_spec_names(tiny_llama_2x64, spec, kind):
    """One constructor for every spec: the cache runs a prompt and 40 steps and holds what it says."""
    from kvlab.hf.policy_cache import held_bytes
    from kvlab.policy.spec import cache_for

    h = tiny_llama_2x64
    p = parse(spec)
    cache = cache_for(p, h)
    assert type(cache).__name__ == kind
    ids = torch.randint(0, 512, (1, 88), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h.run(ids[:, :48], cache)
        for i in range(48, 88):
            h.run(ids[:, i : i + 1], cache)
    per_slot = 2 * 2 * 2 * 16 * h.dtype.itemsize  # K and V, 2 layers, 2 heads x 16
    if p.exact:
        assert held_bytes(cache) == 88 * per_slot
    elif p.codec is not None or isinstance(p.layout, ScoredLayout):
        assert held_bytes(cache) < 88 * per_slot
    # a full-precision RollingCache counts its spare room too (buffers sized for window + 2 chunks)
    if isinstance(p.layout, SinksWindowLayout):
        assert cache.kept <= p.layout.sinks + p.layout.window and (p.codec is None) == (cache.codec is None)
