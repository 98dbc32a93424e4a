"""Decode attention read from packed codes (kvlab.policy.quant.attention) equals attention over what the
cache decodes to, and a bound quantizing CompressedCache takes that path under the model and generate."""

from __future__ import annotations

import math

import pytest
import torch

import kvlab.policy.quant.attention as qa
from kvlab import kernels
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.policy.quant import KIVIQuantizer, PerTokenQuantizer, PreRopeQuantizer, RotatedQuantizer
from kvlab.rope.spec import RopeSpec
from tests.layers_ref import logits_after_layers
from tests.tolerances import assert_forward_close, elementwise_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rope(d: int, *, pairing="half", rotary_dim=None, scaling=1.0) -> RopeSpec:
    r = rotary_dim or d
    inv = tuple(float(10000.0 ** (-2 * i / r)) for i in range(r // 2))
    return RopeSpec(inv, d, pairing=pairing, attention_scaling=scaling)


def _segments(q, rope, *, heads=3, d=64, lengths=(40, 8, 33), start=5, seed=0):
    """Quantized segments of random post-RoPE-like K/V at contiguous positions from ``start``."""
    gen = torch.Generator().manual_seed(seed)
    segs, pos = [], start
    for n in lengths:
        k = torch.randn(1, heads, n, d, generator=gen) * 2 + torch.randn(1, heads, 1, d, generator=gen) * 3
        v = torch.randn(1, heads, n, d, generator=gen) + torch.randn(1, heads, 1, d, generator=gen)
        segs.append(q.encode(k, v, torch.arange(pos, pos + n), rope))
        pos += n
    return segs


def _reference(segs, q, fp_k, fp_v, scaling):
    """float64 softmax attention over the segments' decoded K/V plus the full-precision parts."""
    ks = [s.decode()[0][0] for s in segs] + [fp_k]
    vs = [s.decode()[1][0] for s in segs] + [fp_v]
    k, v = torch.cat(ks, dim=-2).double(), torch.cat(vs, dim=-2).double()
    h, d = k.shape[0], k.shape[-1]
    qg = q.double().reshape(h, -1, d)
    w = torch.softmax(qg @ k.transpose(-1, -2) * scaling, dim=-1)
    return (w @ v).reshape(-1, d), (qg @ k.transpose(-1, -2) * scaling)


CASES = {
    "int4 proj-centred, half RoPE": (RotatedQuantizer(bits=4, sinks=0), _rope(64)),
    "int2": (RotatedQuantizer(bits=2, sinks=0), _rope(64)),
    "int8 (uniform levels)": (RotatedQuantizer(bits=8, sinks=0), _rope(64)),
    "groups of 16": (RotatedQuantizer(bits=4, group_size=16), _rope(64)),
    "mean-centred": (RotatedQuantizer(bits=4, center="mean"), _rope(64)),
    "not centred": (RotatedQuantizer(bits=4, center="none"), _rope(64)),
    "keys centred, values not": (RotatedQuantizer(bits=4, center_values=False), _rope(64)),
    "interleaved RoPE": (RotatedQuantizer(bits=4), _rope(64, pairing="interleaved")),
    "partial rotary + attention scaling": (RotatedQuantizer(bits=4), _rope(64, rotary_dim=48, scaling=1.3)),
    "no RoPE on the layer": (RotatedQuantizer(bits=4), None),
    "random rotation": (RotatedQuantizer(bits=4, rotation="random"), _rope(64)),
    "rotation, uniform grid (zero points)": (RotatedQuantizer(bits=4, grid="uniform"), _rope(64)),
    "pertoken int4": (PerTokenQuantizer(bits=4, group_size=32), _rope(64)),
    "pertoken int8 symmetric": (PerTokenQuantizer(bits=8, group_size=16, symmetric=True), _rope(64)),
    "KIVI int2": (KIVIQuantizer(bits=2, group_size=32), _rope(64)),
    "KIVI int4, groups of 16": (KIVIQuantizer(bits=4, group_size=16), _rope(64)),
    "KIVI int8 symmetric": (KIVIQuantizer(bits=8, group_size=16, symmetric=True), None),
}
# KIVI's per-channel keys need segments of whole token groups
LENGTHS = {
    "KIVI int2": (32, 64, 32),
    "KIVI int4, groups of 16": (48, 16, 32),
    "KIVI int8 symmetric": (16, 64),
}


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_attention_equals_attention_over_the_decoded_cache(case, path, monkeypatch):
    """Both packed paths (the C kernel; torch ops on the codes, CUDA's path, here on the CPU) equal float64
    attention over the decoded cache. The torch path decodes a few slots at a time (a small chunk here,
    so segments span several chunks)."""
    monkeypatch.setattr(qa, "CHUNK_ELEMENTS", 3 * 64 * 16)
    quantizer, rope = CASES[case]
    segs = _segments(quantizer, rope, **({"lengths": LENGTHS[case]} if case in LENGTHS else {}))
    plan = qa.segment_plan(segs, path=path)
    assert plan is not None, kernels.why_not(qa.KERNEL)
    assert plan.path == path
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(9, 64, generator=gen)  # 3 query heads per KV head
    fp_k, fp_v = torch.randn(3, 6, 64, generator=gen), torch.randn(3, 6, 64, generator=gen)
    got = qa.decode_attention(plan, q, fp_k, fp_v, 64**-0.5)
    ref, logits = _reference(segs, q, fp_k, fp_v, 64**-0.5)
    # fp32 sums of 64 products per logit; the output moves by at most the logit error times |v|
    tol = elementwise_tol(torch.float32, [logits, fp_v], ops=64) * max(1.0, float(fp_v.abs().max()))
    assert_forward_close(got, ref.float(), None, what=f"packed-code attention ({case})", tol=tol)
    # the mean term matters: attention without it is far off, so this comparison can fail
    if getattr(quantizer, "center", None) == "proj" and rope is not None:
        for seg in segs:
            if seg.keys.coef is not None:
                object.__setattr__(seg.keys, "coef", torch.zeros_like(seg.keys.coef))
        wrong = qa.decode_attention(qa.segment_plan(segs, path=path), q, fp_k, fp_v, 64**-0.5)
        assert float((wrong - ref.float()).abs().max()) > 100 * tol


@pytest.mark.parametrize(
    "case", ["int4 proj-centred, half RoPE", "rotation, uniform grid (zero points)", "KIVI int2"]
)
def test_the_torch_path_equals_the_kernel(case):
    """The two packed paths compute the same sums in another order: equal within float32 rounding."""
    quantizer, rope = CASES[case]
    segs = _segments(quantizer, rope, **({"lengths": LENGTHS[case]} if case in LENGTHS else {}))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 64, generator=gen)
    fp_k, fp_v = torch.randn(3, 4, 64, generator=gen), torch.randn(3, 4, 64, generator=gen)
    kernel = qa.decode_attention(qa.segment_plan(segs, path="kernel"), q, fp_k, fp_v, 64**-0.5)
    torch_ops = qa.decode_attention(qa.segment_plan(segs, path="torch"), q, fp_k, fp_v, 64**-0.5)
    _, logits = _reference(segs, q, fp_k, fp_v, 64**-0.5)
    tol = elementwise_tol(torch.float32, [logits, fp_v], ops=64) * max(1.0, float(fp_v.abs().max()))
    assert_forward_close(torch_ops, kernel, None, what=f"torch path vs C kernel ({case})", tol=tol)


MANY = {
    "pertoken int4, head_dim 16": (PerTokenQuantizer(bits=4, group_size=16), 16),
    "int4 proj-centred, half RoPE": (RotatedQuantizer(bits=4, sinks=0), 64),
}


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("n_segments", [1, 2, 9, 10, 13, 20])
@pytest.mark.parametrize("case", list(MANY))
def test_many_segments_equal_float64_attention(case, n_segments, path):
    """A plan of up to 20 segments (a bound cache holds one per 32 generated tokens) attends as float64
    SDPA over the dequantized segments: no segment-count or length limit in the plan or the kernel.

    The bound is the computation's worst-case float32 rounding (no headroom): a logit takes at most
    ``3 D + 4`` rounded steps (rotating the query, the dot with the codes, the groups' scales and zeros,
    the mean term over ``D / 2`` frequencies), so it is off by at most ``eps (3 D + 4) max_t |q|.|k_t|``
    (absolute values, times the scaling); the softmax turns a logit error
    ``delta`` into weights off by at most ``2 delta`` in sum; and the output sums ``T`` weighted values one
    after another (each decoded with a few more roundings), off by at most ``eps (T + 4) max|v|``."""
    quantizer, d = MANY[case]
    heads, fp = 2, 6
    segs = _segments(quantizer, _rope(d), heads=heads, d=d, lengths=(32,) * n_segments, seed=n_segments)
    plan = qa.segment_plan(segs, path=path)
    assert plan is not None, kernels.why_not(qa.KERNEL)
    assert plan.lengths == (32,) * n_segments and plan.total == 32 * n_segments
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2 * heads, d, generator=gen) * 0.5  # weights spread over every segment
    fp_k, fp_v = torch.randn(heads, fp, d, generator=gen), torch.randn(heads, fp, d, generator=gen)
    got = qa.decode_attention(plan, q, fp_k, fp_v, d**-0.5)
    ref, _ = _reference(segs, q, fp_k, fp_v, d**-0.5)
    k = torch.cat([s.decode()[0][0] for s in segs] + [fp_k], dim=-2).double()
    v = torch.cat([s.decode()[1][0] for s in segs] + [fp_v], dim=-2).double()
    qk_abs = float((q.double().abs().reshape(heads, -1, d) @ k.abs().transpose(-1, -2)).max()) * d**-0.5
    v_max, slots, eps = float(v.abs().max()), k.shape[-2], torch.finfo(torch.float32).eps
    tol = eps * (2 * (3 * d + 4) * qk_abs + slots + 4) * v_max
    assert_forward_close(got, ref.float(), None, what=f"{n_segments} segments ({case}, {path})", tol=tol)
    # a plan that lost one segment (a count or length limit) is far outside that bound
    if n_segments > 1:
        lost = qa.decode_attention(qa.segment_plan(segs[:-1], path=path), q, fp_k, fp_v, d**-0.5)
        assert float((lost.double() - ref).abs().max()) > 2 * tol


def test_a_rounding_level_input_difference_can_move_a_code_by_a_whole_step():
    """Why a bound cache is checked against its own decoded history, never against a second cache fed the
    same tokens: quantization is discontinuous. Keys two float32 ulps apart (what the packed step and
    SDPA leave in the next layer's K/V) straddle a rounding boundary and decode a whole quantization step
    apart. (500 tokens through a 2-layer llama, bound vs unbound cache: layer 1's K/V inputs differ by
    8e-7, so in its 10th segment one group's fp16 scale moves one ulp and a code one step, 0.117, with the
    C kernel (a group's fp16 zero point one ulp, 1e-3, with torch ops); the logits then differ by 2e-4
    (1e-5), while every step of the bound cache equals attention over its own decoded history within
    2e-6.)"""
    quantizer = PerTokenQuantizer(bits=4, group_size=16)
    x = torch.linspace(0.0, 1.5, 16).reshape(1, 1, 1, 16)  # zero point 0, scale fp16(0.1) rounded up
    scale = float(quantizer.encode(x, x, torch.arange(1), None).keys.q.scale)
    boundary = torch.tensor(8.5 * scale, dtype=torch.float32)
    lo, hi = x.clone(), x.clone()
    lo[..., 5] = torch.nextafter(boundary, torch.tensor(0.0))
    hi[..., 5] = torch.nextafter(boundary, torch.tensor(1.0))
    a = quantizer.encode(lo, lo, torch.arange(1), None).keys.decode()
    b = quantizer.encode(hi, hi, torch.arange(1), None).keys.decode()
    assert float((hi - lo).abs().max()) < 2e-7
    assert float((b - a).abs().max()) == pytest.approx(scale, rel=1e-3)


def test_the_kernel_only_ever_sees_host_memory():
    """Every pointer handed to the C kernel is checked at the ctypes boundary: a tensor on another
    device (meta here; CUDA on a GPU machine) is refused, never read as a host address; and the auto
    path sends codes that are not on the CPU to the torch ops."""
    with pytest.raises(UnsupportedModelError, match="host memory"):
        qa._ptr(torch.empty(4, device="meta"))
    assert qa._ptr(None) is None
    assert qa.packed_path("meta") == "torch" and qa.packed_path("cpu", "torch") == "torch"
    with pytest.raises(UnsupportedModelError, match="host memory"):
        qa.packed_path("meta", "kernel")
    with pytest.raises(BadInputError):
        qa.packed_path("cpu", "gpu")


@pytest.mark.parametrize(
    "quantizer", [KIVIQuantizer(bits=4), RotatedQuantizer(bits=4)], ids=["kivi", "rotation"]
)
def test_many_query_heads_per_kv_head(quantizer):
    """71 query heads per KV head (Falcon-7B's multi-query layout): no fixed per-head limit in the kernel."""
    segs = _segments(quantizer, _rope(64), heads=2, lengths=(64, 32))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2 * 71, 64, generator=gen)
    fp_k, fp_v = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    got = qa.decode_attention(qa.segment_plan(segs), q, fp_k, fp_v, 64**-0.5)
    ref, logits = _reference(segs, q, fp_k, fp_v, 64**-0.5)
    tol = elementwise_tol(torch.float32, [logits, fp_v], ops=64) * max(1.0, float(fp_v.abs().max()))
    assert_forward_close(
        got, ref.float(), None, what="packed-code attention, 71 query heads per KV head", tol=tol
    )


def test_segments_the_kernel_cannot_read_go_to_the_reference_path():
    rope = _rope(64)
    assert qa.segment_plan([]) is None
    assert qa.segment_plan(_segments(RotatedQuantizer(bits=4, sketch=True), rope)) is None
    assert qa.segment_plan(_segments(RotatedQuantizer(bits=3), rope)) is None
    assert qa.segment_plan(_segments(KIVIQuantizer(bits=3), rope, lengths=(32, 64))) is None
    assert qa.segment_plan(_segments(PreRopeQuantizer(bits=4), rope, lengths=(32, 64))) is None
    # segments that disagree (another method, other bits) cannot share one plan
    kivi = _segments(KIVIQuantizer(bits=4), rope, lengths=(32,))
    assert qa.segment_plan(kivi + _segments(PerTokenQuantizer(bits=4), rope, lengths=(32,))) is None
    assert qa.segment_plan(kivi + _segments(KIVIQuantizer(bits=2), rope, lengths=(32,))) is None
    assert (
        qa.segment_plan(kivi + _segments(KIVIQuantizer(bits=4, symmetric=True), rope, lengths=(32,))) is None
    )
    assert qa.segment_plan(kivi) is not None
    # a segment claiming more slots than its codes hold is refused, never read past its bytes
    seg = kivi[0]
    assert qa.segment_plan([type(seg)(seg.keys, seg.values, seg.length + 32)]) is None


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = [0]
    real = qa.decode_attention

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(qa, "decode_attention", counting)
    return calls


BOUND = {
    "rotation": RotatedQuantizer(bits=4, group_size=16, sinks=4),
    "kivi": KIVIQuantizer(bits=4, group_size=16, sinks=4, window=16),
    "pertoken": PerTokenQuantizer(bits=4, group_size=16),
}


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("method", list(BOUND))
def test_bound_cache_decodes_on_packed_codes_and_equals_its_decoded_history(
    tiny_model, monkeypatch, method, path
):
    """Each decode step's logits equal the logits over what the cache held before the step (decoded to
    full precision, then SDPA), across segment boundaries (a segment every 32 generated tokens), on
    either packed path; the cache counts the steps each path took."""
    h = tiny_model("llama")
    ids = torch.randint(0, h.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(h.config, quantizer=BOUND[method], model=h.model, packed_path=path)
    with torch.no_grad():
        h.run(ids[:, :90], cache)
    calls = _count_kernel_calls(monkeypatch)
    n_layers = len(cache.layers)
    with torch.no_grad():
        for p in range(90, 160):
            held = [layer.decoded() for layer in cache.layers]
            ref = logits_after_layers(
                h, tuple(k for k, _ in held), tuple(v for _, v in held), [int(ids[0, p])], p
            )
            got = h.run(ids[:, p : p + 1], cache).logits[0]
            assert_forward_close(got, ref, h, what=f"logits of the packed-code step at position {p}")
    assert calls[0] == 70 * n_layers
    assert cache.packed_steps == 70 and cache.packed_steps_by_path == {
        path: 70,
        ({"kernel", "torch"} - {path}).pop(): 0,
    }
    assert len(cache.layers[0].segments) >= 3  # the generated tokens were encoded in blocks on the way


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_bound_cache_over_many_segments_equals_its_own_decoded_history(tiny_model, monkeypatch, path):
    """A segment every 4 generated tokens (instead of 32): 20 steps past 16 segments per layer, each
    step's logits equal attention over what this same cache held before it, decoded. (Compared with a
    second, unbound cache instead, the two drift apart once rounding-level differences in a layer's K/V
    flip one code: see test_a_rounding_level_input_difference_can_move_a_code_by_a_whole_step.)"""
    import kvlab.hf.compressed_layer as cl

    monkeypatch.setattr(cl, "DECODE_BLOCK", 4)
    h = tiny_model("llama")
    ids = torch.randint(0, h.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(6))
    cache = CompressedCache(h.config, quantizer=BOUND["pertoken"], model=h.model, packed_path=path)
    with torch.no_grad():
        h.run(ids[:, :40], cache)
        for p in range(40, 120):
            held = [layer.decoded() for layer in cache.layers]
            ref = logits_after_layers(
                h, tuple(k for k, _ in held), tuple(v for _, v in held), [int(ids[0, p])], p
            )
            got = h.run(ids[:, p : p + 1], cache).logits[0]
            assert_forward_close(got, ref, h, what=f"logits of the packed-code step at position {p}")
    assert cache.packed_steps_by_path[path] == 80
    assert all(len(layer.segments) == 21 for layer in cache.layers)  # the prompt's, then one per 4 tokens


def test_generate_with_a_bound_quantizing_cache_uses_packed_codes(smollm, monkeypatch):
    """model.generate on the bundled model: every decode step attends on the packed codes, and the tokens
    equal generate with the same cache unbound (decode + SDPA) on this prompt."""
    prompt = torch.tensor([smollm.encode("The history of the printing press begins in " * 8)])
    q = RotatedQuantizer(bits=4, sinks=4)
    calls = _count_kernel_calls(monkeypatch)
    bound = CompressedCache(smollm.config, quantizer=q, model=smollm.model)
    kw = {"max_new_tokens": 12, "do_sample": False}
    arg = cache_argument(type(smollm.model))
    a = smollm.model.generate(prompt, **{arg: bound}, **kw)
    b = smollm.model.generate(prompt, **{arg: CompressedCache(smollm.config, quantizer=q)}, **kw)
    assert calls[0] == 11 * len(bound.layers)  # 11 one-token steps after the prompt
    assert a.tolist() == b.tolist()
    assert smollm.model.config._attn_implementation != "kvlab"  # restored after every step


def test_steps_the_kernel_does_not_take_run_the_reference_path(tiny_model, monkeypatch):
    """A batch of two rows, a prompt-sized feed and a pre-RoPE cache attend through SDPA, unchanged."""
    h = tiny_model("llama")
    calls = _count_kernel_calls(monkeypatch)
    ids = torch.randint(0, h.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        two = CompressedCache(h.config, quantizer=RotatedQuantizer(bits=4, group_size=16), model=h.model)
        h.model(ids[:, :64], **{cache_argument(type(h.model)): two})
        pre = CompressedCache(h.config, quantizer=PreRopeQuantizer(bits=4, group_size=16), model=h.model)
        h.run(ids[:1, :64], pre)
        h.run(ids[:1, 64:65], pre)
        one = CompressedCache(h.config, quantizer=RotatedQuantizer(bits=4, group_size=16), model=h.model)
        h.run(ids[:1, :64], one)
        h.run(ids[:1, 64:70], one)  # six tokens at once: not a decode step
    assert calls[0] == 0


def test_without_a_compiler_the_kernel_is_absent_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_ERRORS", {})
    assert kernels.load(qa.KERNEL) is None
    assert "no-such-compiler" in (kernels.why_not(qa.KERNEL) or "")
    assert qa.segment_plan(_segments(RotatedQuantizer(bits=4), _rope(64))) is None  # reference path
    assert not list(tmp_path.glob("kernels/*.so"))  # nothing half-built left behind


@pytest.mark.process  # runs the C compiler
def test_the_kernel_is_built_once_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    first = kernels._build(qa.KERNEL)
    stamp = first.stat().st_mtime_ns
    assert kernels._build(qa.KERNEL) == first and first.stat().st_mtime_ns == stamp
    # the library and its recorded hash; no temporary files left
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(
        [first.name, first.with_suffix(".sha256").name]
    )
    assert math.isfinite(stamp)
