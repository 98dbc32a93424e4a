"""The drop-in transformers cache: generate works, no-op config is exact, and it matches the snapshot path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import DECODE_BLOCK, CompressedCache
from kvlab.policy.evict import SnapKV, StreamingLLM, evict, kept_per_head, observe
from kvlab.policy.quant import KIVIQuantizer, PerTokenQuantizer, RotatedQuantizer, quantize_snapshot
from tests.layers_ref import logits_after_layers
from tests.tolerances import assert_forward_close

# the keyword transformers takes the cache by (``cache`` from 5.24, ``past_key_values`` before)
CACHE_ARG = cache_argument(LlamaForCausalLM)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    return tiny_llama_2x64


IDS = torch.randint(0, 512, (1, 50), generator=torch.Generator().manual_seed(0))


def test_no_compression_reproduces_dynamic_cache_exactly(tiny):
    ref = tiny.model(IDS, use_cache=True).logits
    cache = CompressedCache(tiny.config)
    got = tiny.model(IDS, **{CACHE_ARG: cache}, use_cache=True).logits
    assert torch.equal(got, ref)
    a = tiny.model.generate(IDS, max_new_tokens=6, do_sample=False)
    b = tiny.model.generate(
        IDS, max_new_tokens=6, do_sample=False, **{CACHE_ARG: CompressedCache(tiny.config)}
    )
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "quantizer",
    [
        PerTokenQuantizer(bits=8, group_size=16),
        KIVIQuantizer(bits=2, group_size=16, window=8, sinks=2),
        RotatedQuantizer(bits=4, group_size=16, sinks=4),
    ],
    ids=lambda q: q.name,
)
def test_prefill_holds_exactly_what_quantize_snapshot_holds(tiny, quantizer):
    snap = tiny.prefill(IDS[0].tolist()).snapshot
    ref = quantize_snapshot(snap, quantizer)
    cache = CompressedCache(tiny.config, quantizer=quantizer)
    tiny.model(IDS, **{CACHE_ARG: cache}, use_cache=True)
    for layer, code in zip(cache.layers, ref.layers, strict=True):
        k, v = layer.decoded()
        k2, v2 = code.decode()
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert cache.nbytes == ref.nbytes < snap.nbytes


def test_generate_quantized_streams_into_packed_segments(tiny):
    q = KIVIQuantizer(bits=4, group_size=8, window=4, sinks=2)
    cache = CompressedCache(tiny.config, quantizer=q)
    out = tiny.model.generate(IDS[:, :5], max_new_tokens=30, do_sample=False, **{CACHE_ARG: cache})
    assert out.shape[1] == 35
    layer = cache.layers[0]
    assert cache.get_seq_length() == layer.held == 34  # the last generated token is never fed back
    assert layer.sink_keys.shape[-2] == 2 and len(layer.segments) >= 3 and layer.keys.shape[-2] < 4 + 8


def test_per_token_quantizers_encode_generated_tokens_in_blocks(tiny):
    """One packed segment per generated token would make each step slower than the last: generated
    tokens wait in the full-precision tail and are encoded DECODE_BLOCK at a time."""
    cache = CompressedCache(tiny.config, quantizer=RotatedQuantizer(bits=4, group_size=16, sinks=2))
    out = tiny.model.generate(IDS[:, :20], max_new_tokens=100, do_sample=False, **{CACHE_ARG: cache})
    assert out.shape[1] == 120
    layer = cache.layers[0]
    assert [s.length for s in layer.segments] == [18, DECODE_BLOCK, DECODE_BLOCK, DECODE_BLOCK]
    assert layer.keys.shape[-2] == 119 - 2 - 18 - 3 * DECODE_BLOCK  # the rest waits in the fp tail
    assert cache.get_seq_length() == layer.held == 119


def test_evicting_cache_matches_snapshot_eviction_and_keeps_positions(tiny):
    ids = IDS[0].tolist()
    ev = evict(observe(tiny, ids), SnapKV(window=4, observe=4), keep=0.5)
    cache = CompressedCache(tiny.config, policy=SnapKV(window=4, observe=4), keep=0.5, model=tiny.model)
    tiny.model(IDS, **{CACHE_ARG: cache}, use_cache=True)
    assert all(layer.query_hook is None for layer in cache.layers)  # removed after the prefill
    kept_k, kept_v, _ = kept_per_head(ev)
    for layer, k, v in zip(cache.layers, kept_k, kept_v, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert cache.get_seq_length() == 50 and cache.held == 25
    # Several new tokens at once: default positions continue at 50 and the mask stays causal.
    cont = torch.tensor([[7, 8, 9, 10]])
    got = tiny.model(cont, **{CACHE_ARG: cache}, use_cache=True).logits[0]
    ref = logits_after_layers(tiny, kept_k, kept_v, cont[0].tolist(), 50)
    assert_forward_close(got, ref, tiny, what="logits through CompressedCache")
    masked = tiny.forward(cont[0].tolist(), past=ev).logits  # the offline masked snapshot, the same
    assert_forward_close(masked, ref, tiny, what="logits on the masked snapshot")


def test_bad_configurations_are_refused(tiny):
    # a policy combines with per-token codes only (tests/test_compressed_every.py): KIVI's are per channel
    with pytest.raises(BadInputError, match="pertoken"):
        CompressedCache(
            tiny.config, quantizer=KIVIQuantizer(bits=2, group_size=16), policy=StreamingLLM(), keep=0.5
        )
    with pytest.raises(BadInputError, match="model="):
        CompressedCache(tiny.config, policy=SnapKV(), keep=0.5)
    with pytest.raises(BadInputError, match=r"\(0, 1\]"):
        CompressedCache(tiny.config, policy=StreamingLLM(), keep=0.0)
    with pytest.raises(BadInputError, match="does not divide"):
        CompressedCache(tiny.config, quantizer=PerTokenQuantizer(bits=4, group_size=64))
    from transformers import MistralConfig

    with pytest.raises(UnsupportedModelError, match="sliding"):
        CompressedCache(
            MistralConfig(num_hidden_layers=2, sliding_window=64), quantizer=PerTokenQuantizer(bits=4)
        )


@pytest.mark.real_model
def test_real_model_generate_with_compressed_caches(smollm):
    ids = torch.tensor(
        [smollm.encode("The lighthouse keeper climbed the stairs every evening to light the lamp, and")]
    )
    ref = smollm.model(ids, use_cache=True).logits
    assert torch.equal(
        smollm.model(ids, **{CACHE_ARG: CompressedCache(smollm.config)}, use_cache=True).logits, ref
    )
    plain = smollm.model.generate(ids, max_new_tokens=6, do_sample=False)
    # 8-bit rotation keeps the greedy continuation on this prompt; eviction runs inside generate too
    cache = CompressedCache(smollm.config, quantizer=RotatedQuantizer(bits=8, sinks=4))
    assert torch.equal(
        smollm.model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_ARG: cache}), plain
    )
    tail = cache.layers[0].keys.shape[-2]  # generated tokens wait in the fp tail for a whole block
    assert 0 < tail < DECODE_BLOCK
    packed = cache.get_seq_length() - tail  # 8.5 bits/element + 4 fp32 sinks
    assert cache.nbytes < 0.5 * 46080 * packed + 46080 * tail
    cache = CompressedCache(smollm.config, policy=SnapKV(window=4, observe=4), keep=0.5, model=smollm.model)
    out = smollm.model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_ARG: cache})
    assert out.shape == plain.shape and cache.held < cache.get_seq_length()


@pytest.mark.real_model
@pytest.mark.slow
def test_experiment_smoke(smollm, tmp_path):
    from kvlab.study.experiments import ExperimentContext, get_experiment
    from kvlab.study.runner import run_experiment

    ctx = ExperimentContext(
        out_dir=tmp_path,
        profile="quick",
        options=dict(
            context_tokens=128,
            continuation_tokens=32,
            windows=1,
            bits=[4],
            keeps=[0.5],
            methods=["pertoken", "rotation+sinks"],
            policies=["snapkv", "learned"],
            needle_lengths=[120],
            needle_depths=[0.5],
            needle_configs=["snapkv 50%"],
            timing_steps=0,
        ),
    )
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("compression"), ctx)
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["status"] == "ok" if "status" in doc else True
    configs = result.summary["configs"]
    assert {"full precision", "pertoken int4", "rotation+sinks int4", "snapkv 50%", "learned 50%"} <= set(
        configs
    )
    assert configs["pertoken int4"]["bytes_per_token"] < 0.2 * configs["full precision"]["bytes_per_token"]
    assert configs["snapkv 50%"]["bytes_per_token"] == pytest.approx(
        0.5 * configs["full precision"]["bytes_per_token"]
    )
    for fig in ("pareto.png", "per_layer_distortion.png", "arrays.npz"):
        assert (tmp_path / fig).is_file()
    # KL to the full cache and top-1 agreement of the continuation logits: columns, summary, raw arrays
    for table in result.tables[:2]:
        assert {"KL to full (nats)", "top-1 agreement"} <= set(table.columns), table.title
    assert configs["full precision"]["kl_to_full"]["value"] == 0
    assert configs["full precision"]["top1_to_full"]["value"] == 1
    arrays = np.load(tmp_path / "arrays.npz")
    for name, entry in configs.items():
        kl, top1 = entry["kl_to_full"]["value"], entry["top1_to_full"]["value"]
        assert np.isfinite(kl) and kl >= 0 and 0 <= top1 <= 1, name
        assert arrays[f"{name}/kl_to_full"].shape == arrays[f"{name}/top1_to_full"].shape == (1,)
    assert configs["pertoken int4"]["kl_to_full"]["value"] > 0


@pytest.mark.real_model
def test_experiment_timing_says_which_attention_each_cache_read(smollm, tmp_path):
    """The decode-time table's 'attention read' column comes from the caches' own count of packed-code
    steps: every quantized cache here is bound, so each of its steps read the packed codes."""
    from kvlab.study.experiments import ExperimentContext
    from kvlab.study.experiments.compression import _timing, _timing_table

    ctx = ExperimentContext(out_dir=tmp_path, profile="quick")
    context = smollm.encode("The printing press spread across Europe within decades. " * 12)[:160]
    timing = _timing(ctx, smollm, context, ("pertoken", "kivi+sinks", "rotation+sinks"), (), 3)
    for name in ("pertoken int4", "kivi+sinks int4", "rotation+sinks int4"):
        assert timing[name + " packed"] == 1.0, name
    rows = {row[0]: row[-1] for row in _timing_table(timing).rows}
    assert rows["full precision"] == "full-precision K/V"
    assert rows["kivi+sinks int4"] == "packed codes (C kernel)"
