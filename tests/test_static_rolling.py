"""StaticRollingCache and RollingDecoder: the eager RollingCache's rule, in fixed buffers, captured.

The reference everywhere is :class:`~kvlab.hf.RollingCache` with the same sinks, window, eviction
chunk and re-base mode: every forward must see the same tokens at the same relative positions, so
logits agree to fp32 rounding of RoPE at other absolute positions. Each test runs on the CPU and,
on a machine with CUDA, on the GPU too (where ``mode="cuda-graph"`` is also checked).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.graphs import RollingDecoder
from kvlab.hf.rolling_cache import RollingCache
from kvlab.hf.static_rolling import EMPTY, static_rolling_cache_for
from kvlab.model.random import tiny_random_model
from kvlab.policy.quant.codecs.int4rows import decode_rows, encode4, pack_rows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# fp32 logits of a 2-layer model with O(1) logits: RoPE applied at other absolute positions (a
# re-base, the sinks re-rotated from float64 angles) changes keys by ~1e-7 relative; 100x headroom
LOGIT_TOL = 2e-5


def _model(family: str | None, device: str, tiny_model, max_positions: int = 256):
    if family is None:  # the compression tests' Llama, with a small maximum so re-bases happen
        cfg = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        h = tiny_random_model(cfg, head_dim=16, layers=2)
    else:
        h = tiny_model(family)
    if device != "cpu":
        from kvlab.model.handle import ModelHandle

        h = ModelHandle(h.model.to(device), h.tokenizer, name=h.name + f"@{device}")
    return h


def _ids(n: int, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(h, *, window, sinks, chunk):
    return RollingCache(h.config, h.rope, window=window, sinks=sinks, evict_chunk=chunk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", [None, "qwen2", "phi", "llama3-scaling", "smollm2"])
def test_decode_equals_the_eager_rolling_cache(family, device, tiny_model, one_torch_thread):
    """Prefill, then 1-token steps through many rolls (and, for the small-maximum Llama, re-bases):
    logits and the kept K/V equal RollingCache's at every step."""
    h = _model(family, device, tiny_model)
    vocab = h.config.vocab_size
    ids = _ids(330, vocab).to(device)
    window, sinks, chunk = 40, 4, 8
    ref = _reference(h, window=window, sinks=sinks, chunk=chunk)
    h.run(ids[:20], ref, logits_to_keep=1)
    cache = static_rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk)
    dec = RollingDecoder(h, cache, mode="eager")
    dec.prefill(ids[:20])
    worst = 0.0
    for t in range(20, ids.numel()):
        a = h.run(ids[t : t + 1], ref, logits_to_keep=1).logits[0, -1].float()
        b = dec.feed(ids[t : t + 1])[0]
        worst = max(worst, float((a - b).abs().max()))
    assert worst < LOGIT_TOL
    assert (cache.rolls, cache.kept, cache.next_position) == (ref.rolls, ref.kept, ref.next_position)
    if family is None:
        assert cache.rebases == ref.rebases >= 1  # max position 256, 330 tokens: positions were re-based
    for (k1, v1), (k2, v2) in zip(ref.kept_layers(), cache.kept_layers(), strict=True):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    assert torch.equal(cache.positions(), ref.positions())


@pytest.mark.parametrize("device", DEVICES)
def test_feeding_from_empty_in_chunks(device, tiny_model, one_torch_thread):
    """No eager prefill: the sinks fill from the first feeds, then chunks of up to evict_chunk tokens
    (each forward causal inside itself) and single tokens, as RollingCache fed the same pieces."""
    h = _model(None, device, tiny_model, max_positions=4096)
    ids = _ids(300).to(device)
    ref = _reference(h, window=30, sinks=3, chunk=6)
    cache = static_rolling_cache_for(h, window=30, sinks=3, evict_chunk=6)
    dec = RollingDecoder(h, cache, mode="eager")
    pieces, t = [2, 1, 5, 6, 6, 1, 1, 3, 6, 4], 0
    while t < ids.numel():
        n = min(pieces[t % len(pieces)], ids.numel() - t)
        a = h.run(ids[t : t + n], ref, logits_to_keep=1).logits[0, -1].float()
        b = dec.feed(ids[t : t + n])[0]
        assert float((a - b).abs().max()) < LOGIT_TOL, t
        t += n
    assert cache.rolls == ref.rolls > 10


def test_refusals(tiny_model):
    h = _model(None, "cpu", tiny_model)
    cache = static_rolling_cache_for(h, window=20, sinks=2, evict_chunk=4)
    dec = RollingDecoder(h, cache, mode="eager")
    dec.prefill(_ids(10))
    with pytest.raises(BadInputError, match="evict_chunk"):
        dec.feed(_ids(5))  # more than one chunk at once after the first feed
    with pytest.raises(BadInputError, match="empty"):
        dec.prefill(_ids(3))
    with pytest.raises(BadInputError, match="cuda-graph"):
        RollingDecoder(h, static_rolling_cache_for(h, window=100), mode="cuda-graph")
    with pytest.raises(BadInputError, match="mode"):
        RollingDecoder(h, static_rolling_cache_for(h, window=100), mode="fast")  # type: ignore[arg-type]
    other = RollingCache(h.config, h.rope, window=21, sinks=2, evict_chunk=4)
    h.run(_ids(5), other)
    with pytest.raises(BadInputError, match="same sinks"):
        static_rolling_cache_for(h, window=20, sinks=2, evict_chunk=4).load(other)
    rebasing = RollingCache(h.config, h.rope, window=20, sinks=2, evict_chunk=4, rebase="always")
    h.run(_ids(5), rebasing)
    fresh = static_rolling_cache_for(h, window=20, sinks=2, evict_chunk=4)
    with pytest.raises(BadInputError, match="same rule"):
        fresh.load(rebasing)
    assert fresh.tokens_seen == 0 and bool((fresh.slot_pos == EMPTY).all())  # refused before writing
    with pytest.raises(BadInputError, match="int4 group"):
        static_rolling_cache_for(h, window=100, codec="int4", group=5)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        static_rolling_cache_for(tiny_model("mistral"), window=100)


def test_int4_codes_bound_and_layout():
    """Every element decodes within half a step of its group (plus fp32 rounding), and the codes are
    laid out as kvlab's pack_bits lays out 4-bit codes (QuantizedTensor decodes them identically)."""
    from kvlab.policy.quant.scalar import QuantizedTensor

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 50, 64, generator=g) * torch.logspace(-3, 2, 64)  # outlier channels
    x[0, 0, 0] = 0.0  # an all-zero token
    codes, scale, low = encode4(x, 32)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 50, 32) and scale.shape == (2, 3, 50, 2)
    y = decode_rows(pack_rows(x, 32), 64, torch.float32)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(((x - y).abs() <= step / 2 + 1e-6 * x.abs() + 1e-7).all())
    q = QuantizedTensor(codes.reshape(-1), scale, low, 4, tuple(x.shape), 32, torch.float32)
    assert torch.equal(q.dequantize(), y)


def test_the_rings_int4_is_a_registered_codec_within_half_a_step(tiny_model):
    """The ring's ``codec="int4"`` resolves through the codec registry to ``int4rows``; that codec's
    segments hold the ring's codes, scales and minimums (the kernel's rows) and decode within half a step."""
    from kvlab.hf.static_rolling import RING_CODECS
    from kvlab.kernels.split_attention import int4_rows
    from kvlab.policy.quant.codecs.int4rows import Int4RowsQuantizer
    from kvlab.policy.quant.methods import QUANTIZERS, make_quantizer, quantizer_names

    assert RING_CODECS["int4"] == "int4rows" and "int4rows" in quantizer_names()
    assert QUANTIZERS["int4rows"] is Int4RowsQuantizer
    codec = make_quantizer("int4rows", group_size=16)
    assert codec.name == "int4rows" and codec.bits == 4
    ring = static_rolling_cache_for(_model(None, "cpu", tiny_model), window=40, codec="int4", group=16)
    assert ring.coder == codec
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 9, 64, generator=g) * torch.logspace(-2, 1, 64)
    v = torch.randn(1, 2, 9, 64, generator=g)
    seg = codec.encode(k, v, torch.arange(9), None)
    assert seg.nbytes == 2 * 2 * 9 * (32 + 4 * 4)  # per row: 32 code bytes, 4 fp16 scales and minimums
    for x, code, y in ((k, seg.keys, seg.decode()[0]), (v, seg.values, seg.decode()[1])):
        rows = pack_rows(x, 16)  # what the ring stores: the same codes, scales and minimums
        codes, scale, low = int4_rows(rows, 64)
        assert torch.equal(code.q.packed, codes.reshape(-1)) and torch.equal(code.q.scale, scale)
        assert torch.equal(code.q.zero, low) and torch.equal(y, decode_rows(rows, 64, x.dtype))
        step = scale.float().repeat_interleave(16, dim=-1)
        assert bool(((x - y).abs() <= step / 2 + 1e-6 * x.abs() + 1e-7).all())
    with pytest.raises(BadInputError, match="int4 group"):
        make_quantizer("int4rows", group_size=6).check(64, None)


@pytest.mark.parametrize("device", DEVICES)
def test_int4_cache_holds_the_quantized_keys_and_a_third_of_the_bytes(device, tiny_model, one_torch_thread):
    """Layer 0's K/V depend only on the token embeddings, so the int4 cache's layer 0 holds exactly the
    full-precision cache's layer 0 quantized: within the codes' bound, slot for slot, after rolls."""
    h = _model(None, device, tiny_model, max_positions=4096)
    ids = _ids(200).to(device)
    caches = {
        c: static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8, codec=c, group=8)
        for c in ("none", "int4")
    }
    for c in caches.values():
        dec = RollingDecoder(h, c, mode="eager")
        dec.prefill(ids[:30])
        for t in range(30, 200):
            dec.feed(ids[t : t + 1])
    (k, v), (kq, vq) = caches["none"].kept_layers()[0], caches["int4"].kept_layers()[0]
    for full, quant in ((k, kq), (v, vq)):
        groups = full.float().unflatten(-1, (-1, 8))
        step = (groups.amax(-1) - groups.amin(-1)) / 15
        bound = step.repeat_interleave(8, dim=-1) * (0.5 + 2e-3) + 1e-6
        assert bool(((full - quant).abs() <= bound).all())
    fp, q4 = caches["none"], caches["int4"]
    per_slot_fp = 2 * 16 * 4  # keys + values, head_dim 16, fp32
    per_slot_q4 = 2 * (16 // 2 + 2 * 2 * (16 // 8))  # codes + fp16 scale and minimum per group of 8
    slots = fp.capacity * 2 * 2  # layers x kv heads
    sinks = 2 * 2 * 4 * per_slot_fp  # layers x kv heads x sinks: the stored originals (int4: K and V)
    assert fp.nbytes() == slots * per_slot_fp + sinks // 2 + fp.capacity * 8
    assert q4.nbytes() == slots * per_slot_q4 + sinks + q4.capacity * 8


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack((codes & 15, codes >> 4), dim=-1).int()


def _twins(h, ids, codec: str, mode: str):
    """An eager decoder and one in ``mode`` on equal caches (window 40, 4 sinks, chunks of 8), both
    prefilled with the first 20 tokens of ``ids``: ``(eager, its cache, captured, its cache)``."""
    pair = []
    for m in ("eager", mode):
        cache = static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8, codec=codec, group=8)
        dec = RollingDecoder(h, cache, mode=m)
        dec.prefill(ids[:20])
        pair += [dec, cache]
    return tuple(pair)


@pytest.mark.slow
def test_each_decoder_compiles_against_its_own_recompile_limit(tiny_model, one_torch_thread):
    """Dynamo counts recompiles per code object: decoders that shared RollingDecoder._step's added up, and a
    process that made a few (the test suite) failed with "recompile limit exceeded". With the limit at 1,
    two decoders over two models each compile their one graph."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=1):
        for seed in (0, 1):
            h = _model(None, "cpu", tiny_model)
            torch.manual_seed(seed)
            dec = RollingDecoder(
                h, static_rolling_cache_for(h, window=16, sinks=4, evict_chunk=4), mode="compile"
            )
            dec.prefill(_ids(9, seed=seed))
            dec.feed(_ids(1, seed=seed))
            assert dec.captures == 1


@pytest.mark.slow
def test_a_compiled_step_follows_its_model_changed_after_it_compiled(tiny_model, one_torch_thread):
    """A compiled step follows its model. Its CPU graph holds the weights as constants (frozen): a weight
    changed in place (which no Dynamo guard sees), a parameter replaced, a forward hook added (which Dynamo's
    guards ignore by default) and removed, the replaced parameter changed in place, and a weight's ``.data``
    assigned (which moves no version counter) each compile the step again, whose logits then equal the
    eager step's on the changed model."""
    h = _model(None, "cpu", tiny_model)  # a model of its own: this test changes it
    ids = _ids(40)
    eager, _, dec, _ = _twins(h, ids, "none", "compile")

    def step(t: int, captures: int) -> None:
        a, b = eager.feed(ids[t : t + 1]), dec.feed(ids[t : t + 1])
        assert float((a - b).abs().max()) < LOGIT_TOL, t
        assert dec.captures == captures, t

    step(20, 1)
    step(21, 1)
    layer = h.model.model.layers[1]
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(1.5)
    step(22, 2)
    layer.self_attn.o_proj.weight = torch.nn.Parameter(-layer.self_attn.o_proj.weight.detach())
    step(23, 3)
    hook = layer.mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    step(24, 4)  # Dynamo's guards (by its default) do not see a hook added after it compiled
    hook.remove()
    step(25, 5)
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(0.5)  # the replaced weight, changed in place
    step(26, 6)
    layer.mlp.up_proj.weight.data = layer.mlp.up_proj.weight.detach() * 0.75
    step(27, 7)
    step(28, 7)


@pytest.mark.slow
def test_a_compiled_step_drops_only_the_guards_its_check_covers(tiny_model, one_torch_thread):
    """The compiled step's guard filter drops Dynamo's identity guards on the model's own parameters and
    buffers (what kvlab's check compares before each step), and nothing else."""
    from kvlab.hf import graphs

    h = _model(None, "cpu", tiny_model)
    ids = _ids(40)
    seen: list[tuple[object, bool]] = []
    real = graphs._ModelParts.guards

    def guards(self, entries):
        keep = real(self, entries)
        seen.extend((e, k) for e, k in zip(entries, keep, strict=True))
        return keep

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs._ModelParts, "guards", guards)
        eager, _, dec, _ = _twins(h, ids, "none", "compile")
        a, b = eager.feed(ids[20:21]), dec.feed(ids[20:21])
    assert float((a - b).abs().max()) < LOGIT_TOL
    tensors = {id(t) for t in [*h.model.parameters(), *h.model.buffers()]}
    dropped = [e for e, keep in seen if not keep]
    assert len(dropped) >= len(list(h.model.parameters())) and len(dropped) < len(seen)
    assert all(e.guard_type == "ID_MATCH" and id(e.value) in tensors for e in dropped)
    assert any(e.guard_type == "ID_MATCH" for e, keep in seen if keep)  # others' identity guards stay


@pytest.mark.slow
def test_a_compiled_step_follows_a_new_model_of_the_same_shape(tiny_model, one_torch_thread):
    """A handle given another model of the same architecture (other weights): kvlab's check sees it and
    makes the step again, whose logits are the new model's. Dynamo's guards no longer match the old
    model's tensors by identity (the filter above); those it keeps on the modules see it too."""
    import copy

    h = _model(None, "cpu", tiny_model)
    ids = _ids(40)
    eager, _, dec, _ = _twins(h, ids, "none", "compile")
    a, b = eager.feed(ids[20:21]), dec.feed(ids[20:21])
    assert float((a - b).abs().max()) < LOGIT_TOL and dec.captures == 1
    other = copy.deepcopy(h.model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.25)
    h.model = other
    a, b = eager.feed(ids[21:22]), dec.feed(ids[21:22])
    assert float((a - b).abs().max()) < LOGIT_TOL and dec.captures == 2


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "int4"])
def test_compiled_fullgraph_step_equals_eager(codec, tiny_model, one_torch_thread):
    """torch.compile(fullgraph=True) over the decode step (inductor, on the CPU): one graph for 100
    steps with 10 rolls (no recompiles, no graph breaks). Full precision: the eager logits. int4:
    inductor may divide by a reciprocal or fuse a multiply-add, so a value on a rounding boundary can
    take the neighbouring code (seen with torch 2.11; both codes are within the codec's bound): layer 0,
    whose K/V depend on the tokens alone, holds the same codes up to such flips (one step, rare)."""
    _check_compiled(_model(None, "cpu", tiny_model, max_positions=4096), _ids(120), codec, LOGIT_TOL)


def _check_compiled(h, ids, codec: str, tol: float):
    """100 steps with 10 rolls, eager against ``torch.compile(fullgraph=True)``: one graph, no breaks,
    logits within ``tol`` (full precision); int4: layer 0's codes equal up to rare one-step flips."""
    import torch._dynamo

    eager, ref, dec, cache = _twins(h, ids, codec, "compile")
    torch._dynamo.utils.counters.clear()
    worst = 0.0
    for t in range(20, 120):
        worst = max(worst, float((eager.feed(ids[t : t + 1]) - dec.feed(ids[t : t + 1])).abs().max()))
    assert cache.rolls == ref.rolls == 10
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    if codec == "none":
        assert worst < tol
        return dec
    from kvlab.kernels.split_attention import int4_rows

    for name in ("k_store", "v_store"):
        a, b = (_nibbles(int4_rows(getattr(c.layers[0], name), c.head_dim)[0]) for c in (ref, cache))
        assert int((a - b).abs().max()) <= 1 and float((a != b).float().mean()) < 0.01
    assert worst < 0.25  # a sanity check (a flipped code moves one value by one step), not a bound
    return dec


if torch.cuda.is_available():  # defined only where it can run (a skipped test fails `make test`)

    @pytest.mark.parametrize("codec", ["none", "int4"])
    def test_cuda_graph_step_equals_eager(codec, tiny_model):
        """Captured 1-token and chunk feeds replay what the eager step computes, rolls included."""
        h = _model(None, "cuda", tiny_model, max_positions=4096)
        ids = _ids(150).cuda()
        eager, ref, dec, cache = _twins(h, ids, codec, "cuda-graph")
        t, sizes = 20, set()
        while t < 150:
            n = min(8 if t % 3 == 0 else 1, 150 - t)
            a, b = eager.feed(ids[t : t + n]), dec.feed(ids[t : t + n])
            assert float((a - b).abs().max()) < LOGIT_TOL, t
            t, sizes = t + n, sizes | {n}
        assert dec.captures == len(sizes) and cache.rolls == ref.rolls > 10  # one graph per feed size
        assert dec.attention == ("kvlab_split" if _has_triton() else "kvlab_grouped")

    @pytest.mark.parametrize("codec", ["none", "int4"])
    def test_compiled_fullgraph_cuda_step_equals_eager(codec, tiny_model):
        """The same on CUDA, where attention is the Triton split kernel inside the compiled graph (inductor
        passes its float scale as fp64: the kernel once failed to compile there, tests/optional checks
        that front end without a GPU). fp32 throughout; inductor's own kernels sum norms and the softmax
        merge in another order than eager: ~1e-6 relative per layer, 1e-4 leaves headroom."""
        h = _model(None, "cuda", tiny_model, max_positions=4096)
        dec = _check_compiled(h, _ids(120).cuda(), codec, 1e-4)
        assert dec.attention == ("kvlab_split" if _has_triton() else "kvlab_grouped")

    def _has_triton() -> bool:
        import importlib.util

        return importlib.util.find_spec("triton") is not None

    @pytest.mark.parametrize(
        "n, length, head_dim", [(1, 300, 64), (1, 4100, 128), (64, 2000, 128), (3, 257, 80)]
    )
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("int4", [False, True])
    @pytest.mark.parametrize("positions", [False, True])
    def test_split_attention_kernel_equals_sdpa(n, length, head_dim, dtype, int4, positions):
        """The Triton split-KV kernel (tuned launch) against SDPA over repeated heads, with masked regions
        that leave whole slices of the cache empty; int4: packed rows decoded inside the kernel against
        SDPA over the same rows decoded by ``decode_rows``. ``positions``: the kernel is given the
        rule the mask was made by (slot positions, empty slots included, against each row's query
        positions) and applies it without reading the mask. Tolerance: fp32 accumulation (fp32 inputs:
        IEEE products; bf16: P rounded to bf16 before P @ V)."""
        if not _has_triton():
            pytest.fail("triton is not importable on this CUDA machine")
        from transformers.integrations.sdpa_attention import repeat_kv

        from kvlab.kernels import split_attention as sa
        from kvlab.policy.quant.codecs.int4rows import decode_rows, pack_rows

        assert sa.prepare(torch.device("cuda"))
        g = torch.Generator(device="cuda").manual_seed(0)
        b, h, groups = 2, 8, 4
        q = torch.randn(b, h * groups, n, head_dim, generator=g, device="cuda").to(dtype)
        k, v = (torch.randn(b, h, length, head_dim, generator=g, device="cuda").to(dtype) for _ in range(2))
        if int4:
            k, v = (pack_rows(t, 16) for t in (k, v))
            kd, vd = (decode_rows(t, head_dim, dtype) for t in (k, v))
        else:
            kd, vd = k, v
        rule = None
        if positions:
            slot_pos = torch.randint(0, 3 * length, (length,), generator=g, device="cuda")
            slot_pos[100:250] = 1 << 62  # empty slots: whole slices of the cache see nothing
            slot_pos[0] = 0
            query_pos = torch.randint(0, 3 * length, (b, n), generator=g, device="cuda")
            visible = slot_pos[None, None, None, :] <= query_pos[:, None, :, None]
            rule = (slot_pos, query_pos)
        else:
            visible = torch.rand(b, 1, n, length, generator=g, device="cuda") < 0.7
            visible[..., 0] = True
            visible[..., 100:250] = False
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(),
            repeat_kv(kd, groups).float(),
            repeat_kv(vd, groups).float(),
            attn_mask=mask.float(),
            scale=0.1,
        )
        out = sa.attend(q.reshape(b, h, groups * n, head_dim), k, v, mask, 0.1, rule).reshape(
            b, h * groups, n, head_dim
        )
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((out.float() - ref).abs().max()) < tol

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_int4_writer_writes_the_bytes_of_pack4_on_cuda(dtype):
        """The one-kernel int4 writer of a captured step: exactly the torch encoder's bytes, at the given
        slots only (compiled for the card, fp fusion off: no contracted multiply-add)."""
        if not _has_triton():
            pytest.fail("triton is not importable on this CUDA machine")
        from kvlab.kernels import split_attention as sa
        from kvlab.policy.quant.codecs.int4rows import pack_rows

        assert sa.prepare(torch.device("cuda"))
        g = torch.Generator(device="cuda").manual_seed(1)
        x = (torch.randn(2, 8, 64, 128, generator=g, device="cuda") * 3).to(dtype)
        x[0, 0, 0, :32] = 0.0
        packed = torch.zeros(2, 8, 300, 64 + 16, dtype=torch.uint8, device="cuda")
        index = torch.randperm(300, generator=g, device="cuda")[:64]
        sa.write_int4(packed, index, x, 32)
        ref = torch.zeros_like(packed)
        ref.index_copy_(2, index, pack_rows(x, 32))
        assert int((packed != ref).sum()) == 0


@pytest.mark.parametrize("n", [1, 5])
def test_grouped_attention_equals_sdpa_with_repeated_heads(n):
    """kvlab's grouped attention (query heads stacked per KV head) is SDPA over repeated K/V heads."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import repeat_kv

    from kvlab.hf.graphs import _grouped_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 16, generator=g) for h, t in ((8, n), (2, 40), (2, 40)))
    mask = torch.where(torch.rand(2, 1, n, 40, generator=g) < 0.3, float("-inf"), 0.0)
    mask[..., 0] = 0.0  # every query sees something
    got, _ = _grouped_attention(SimpleNamespace(), q, k, v, mask, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask, scale=0.25
    )
    assert torch.allclose(got, ref.transpose(1, 2), atol=1e-6)


def test_decoder_steps_use_grouped_attention_and_restore_the_model(tiny_model, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvlab.hf import graphs

    h = _model(None, "cpu", tiny_model)
    calls = []
    inner = ALL_ATTENTION_FUNCTIONS[graphs.GROUPED_ATTENTION]
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping,
        graphs.GROUPED_ATTENTION,
        lambda *a, **k: calls.append(1) or inner(*a, **k),
    )
    dec = RollingDecoder(h, static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8), mode="eager")
    dec.prefill(_ids(10))
    dec.feed(_ids(3))
    assert len(calls) == 2  # one step, two layers (the prefill ran the model's own attention)
    assert h.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("batch", [1, 2])
def test_split_steps_get_the_rule_their_mask_was_made_by(batch, tiny_model, monkeypatch, one_torch_thread):
    """The split kernel is handed (slot positions, feed positions) through the model's attention kwargs
    and then never reads the mask: so at every step of a decode with rolls and re-bases, that rule must
    give exactly the mask the step built. Run on the CPU with the kernel replaced by SDPA over the mask
    the rule makes (the kernel itself: tests/optional/test_triton_kernels.py); the logits equal the
    grouped-SDPA decoder's."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from kvlab.kernels import split_attention

    h = _model(None, "cpu", tiny_model, max_positions=64)
    seen: list[int] = []

    def attend(q, k, v, mask, scale, visibility=None):
        assert visibility is not None, "the split attention was not given the rule"
        slot_pos, query_pos = visibility
        ruled = slot_pos[None, None, None, :] <= query_pos[:, None, :, None]
        assert torch.equal(ruled.expand(mask.shape), mask == 0), "the rule and the mask disagree"
        seen.append(int(query_pos.shape[1]))
        groups = q.shape[2] // mask.shape[2]
        b, hk, _, d = q.shape
        qh = q.reshape(b, hk * groups, -1, d)
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=ruled, scale=scale
        )
        return out.reshape(q.shape)

    ids = torch.stack([_ids(150, seed=s) for s in range(batch)])
    logits = {}
    for split in (True, False):
        with monkeypatch.context() as m:
            m.setattr(split_attention, "prepare", lambda device, split=split: split)
            m.setattr(split_attention, "attend", attend)
            cache = static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8, batch=batch)
            dec = RollingDecoder(h, cache, mode="eager")
            assert dec.attention == ("kvlab_split" if split else "kvlab_grouped")
            dec.prefill(ids[:, :20])
            t, rows = 20, []
            while t < 150:
                n = 8 if t % 3 == 0 else 1
                rows.append(dec.feed(ids[:, t : t + n]))
                t += n
            logits[split] = torch.cat(rows)
            assert cache.rolls >= 10 and cache.rebases >= 1
    assert {1, 8} <= set(seen)  # decode steps and chunk feeds
    assert float((logits[True] - logits[False]).abs().max()) < LOGIT_TOL


@pytest.mark.parametrize("name", ["attention_mask", "position_ids", "past_key_values", "logits_to_keep"])
def test_attention_kwargs_may_not_replace_the_models_own_arguments(name, tiny_model):
    """``ModelHandle.run(attention_kwargs=)`` adds to what the model gets, never overrides it: a clash is
    refused in one line before the model (or the cache) is touched."""
    h = _model(None, "cpu", tiny_model)
    cache = RollingCache(h.config, h.rope, window=40, sinks=4, evict_chunk=8)
    with pytest.raises(BadInputError, match=f"own arguments \\['{name}'\\]"):
        h.run(_ids(5), cache, attention_kwargs={name: None})
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("codec", ["none", "int4"])
def test_clone_continues_alike_and_independently(codec, tiny_model, one_torch_thread):
    """A clone in mid-stream (sinks kept, rolls pending) decodes exactly as its original would, and
    feeding it leaves the original's buffers, sinks and counts untouched."""
    h = _model(None, "cpu", tiny_model)
    ids = _ids(120)
    cache = static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8, codec=codec, group=8)
    dec = RollingDecoder(h, cache, mode="eager")
    dec.prefill(ids[:20])
    for t in range(20, 70):
        dec.feed(ids[t : t + 1])
    twin = cache.clone()
    before = ({k: v.clone() for k, v in cache.storage.items()}, cache.sink_keys.clone(), cache.describe())
    other = RollingDecoder(h, twin, mode="eager")
    theirs = torch.stack([other.feed(ids[t : t + 1]) for t in range(70, 120)])
    assert twin.rolls > cache.rolls
    assert all(torch.equal(before[0][k], cache.storage[k]) for k in before[0])
    assert torch.equal(before[1], cache.sink_keys) and cache.describe() == before[2]
    mine = torch.stack([dec.feed(ids[t : t + 1]) for t in range(70, 120)])
    assert torch.equal(mine, theirs)


def test_split_launch_overrides_parse_or_are_refused():
    """KVLAB_SPLIT_LAUNCH (read where the Triton kernels are prepared): well-formed items become launch
    shapes (keys per block and programs per SM default to 64 and 4); anything else is one clear error
    naming the item, never a silently different launch."""
    from kvlab.kernels.split_attention import parse_launches

    assert parse_launches(" many,int4=128x8x3x128x1 ; few,none=16x4x2;") == {
        ("many", True): (128, 8, 3, 128, 1),
        ("few", False): (16, 4, 2, 64, 4),
    }
    assert parse_launches("") == {}
    for bad in (
        "many=128x8x3",
        "lots,none=16x4x2",
        "few,int8=16x4x2",
        "few,none=16x4",
        "few,none=24x4x2",
        "few,none=axbxc",
    ):
        with pytest.raises(BadInputError, match="KVLAB_SPLIT_LAUNCH item"):
            parse_launches(bad)


def test_load_refuses_a_rolling_cache_without_its_sinks_originals(tiny_model):
    """A RollingCache that holds its sinks but not their original keys on some layer cannot be rolled
    correctly here (the sinks could never be re-rotated): load() refuses before writing anything."""
    h = _model(None, "cpu", tiny_model)
    ref = _reference(h, window=40, sinks=4, chunk=8)
    h.run(_ids(30), ref, logits_to_keep=1)
    ref.layers[1].sink_keys = None
    cache = static_rolling_cache_for(h, window=40, sinks=4, evict_chunk=8)
    before = cache.storage["keys"].clone()
    with pytest.raises(BadInputError, match="original keys"):
        cache.load(ref)
    assert cache.tokens_seen == 0 and torch.equal(before, cache.storage["keys"])
