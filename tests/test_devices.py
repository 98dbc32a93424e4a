"""Every path of issue 29's first table runs on each device there is, and on CUDA equals its CPU result.

A CPU-only machine cannot see a tensor made on the CPU next to data on ``cuda``. So on the CPU each path
also runs with ``meta`` as torch's default device, switched on only around the operation under test
(the model and the inputs exist before): a factory that forgot ``device=`` then makes a meta tensor, and
the first operation mixing it with the CPU data raises (:func:`test_the_meta_default_exposes_a_factory_without_a_device`
checks that torch does, for the operations involved). A few operations do not raise (indexing a CPU
tensor with a meta index quietly reads nothing real), so every test also compares the result with the
plain run and checks that nothing came back on ``meta``.

Where CUDA is available (``make test-gpu`` on a GPU machine) the same tests run on ``cuda`` too: the
result must live on ``cuda`` and equal the CPU result within a tolerance derived from the dtype (fp32
on both) and the computation (:mod:`tests.tolerances`). Never skipped: the device list is what exists.
Only tiny random models (no bundled model, no Redis), so this file runs on any GPU machine.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from kvlab.cache import load_snapshot, save_snapshot, stack_rows
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.model.handle import ModelHandle
from kvlab.ops.press import Press
from kvlab.policy.evict import evict, make_policy, observe
from kvlab.policy.quant import KIVIQuantizer, PerTokenQuantizer, RotatedQuantizer
from kvlab.store import DiskTier, KVStore, MemoryTier, prefill_with_store, reuse_generate
from kvlab.streaming import stream_nll
from tests.layers_ref import logits_after_layers
from tests.tolerances import forward_tol, max_abs_diff, rope_angle_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

_GEN = torch.Generator().manual_seed(29)
PROMPT = torch.randint(3, 500, (64,), generator=_GEN).tolist()
MORE = torch.randint(3, 500, (24,), generator=_GEN).tolist()
STREAM = torch.randint(3, 500, (80,), generator=_GEN).tolist()


@pytest.fixture(scope="module")
def handles(tiny_llama_2x64) -> dict[str, ModelHandle]:
    """The same tiny model on every device (one copy each; the fingerprint does not depend on the device)."""
    h = tiny_llama_2x64
    out = {"cpu": h}
    for device in DEVICES[1:]:
        model = copy.deepcopy(h.model).to(device)
        out[device] = ModelHandle(model, h.tokenizer, name=h.name, weights_digest=h.weights_digest())
    return out


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


Result = dict[str, Any]


def on_device(
    device: str,
    handles: dict[str, ModelHandle],
    path: Callable[[ModelHandle], Result],
    *,
    tol: Callable[[Result], dict[str, float]] | None = None,
    host: tuple[str, ...] = (),
) -> Result:
    """Run ``path(handle)`` (a dict of tensors, tensor lists or plain values) and check it.

    ``cpu``: plain, then with ``meta`` as the default device; both equal within fp32 rounding and nothing
    on ``meta``. Another device: every tensor result lives there (but those named in ``host``, which
    kvlab hands back on the host) and equals the CPU result within ``tol(cpu result)[name]`` (default:
    the forward-pass bound for fp32 at the result's magnitude).
    """
    expected = path(handles["cpu"])
    bounds = tol(expected) if tol is not None else {}
    if device == "cpu":
        with torch.device("meta"):
            got = path(handles["cpu"])
        assert not any(t.is_meta for v in got.values() for t in _tensors(v)), "a result came back on meta"
    else:
        got = path(handles[device])
        for name, value in got.items():
            for t in _tensors(value):
                want_type = "cpu" if name in host else torch.device(device).type
                assert t.device.type == want_type, f"{name} came back on {t.device}"
    for name, want in expected.items():
        have = got[name]
        if not _tensors(want):
            assert have == want, f"{name} on {device}: {have} != {want}"
            continue
        bound = bounds.get(name) or forward_tol(handles["cpu"], _tensors(want))
        err = max_abs_diff([t.cpu() for t in _tensors(have)], _tensors(want))
        assert err <= bound, f"{name} on {device}: max |diff| {err:.3g} > {bound:.3g}"
    return got


def _ids(h: ModelHandle, ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=h.device)


def _generate(h: ModelHandle, ids: torch.Tensor, cache: Any, n: int, mask: torch.Tensor | None = None) -> Any:
    with torch.no_grad():
        return h.model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,  # the model's own logits (scores carry -inf from min_new_tokens)
            return_dict_in_generate=True,
            **{cache_argument(h.model): cache},
        )


def _decode(h: ModelHandle, cache: Any, prompt: list[int], more: list[int]) -> torch.Tensor:
    """Next-token logits after ``prompt`` and after each of ``more``, one token at a time, on ``cache``."""
    with torch.no_grad():
        first = h.run(_ids(h, prompt), cache, logits_to_keep=1).logits[0, -1]
    return torch.cat((first[None], _decode_more(h, cache, more)))


def _decode_more(h: ModelHandle, cache: Any, more: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([h.run(_ids(h, [t]), cache, logits_to_keep=1).logits[0, -1] for t in more])


# -- the trick itself -------------------------------------------------------------------------------------


def _raises(op: Callable[[], Any]) -> bool:
    try:
        op()
    except (RuntimeError, NotImplementedError):
        return True
    return False


def test_the_meta_default_exposes_a_factory_without_a_device():
    """What the CPU runs rely on: under ``torch.device("meta")`` a factory without ``device=`` makes a meta
    tensor, one with a device or a source (``*_like``) does not, and elementwise arithmetic, ``cat`` and
    matrix products that mix it with CPU tensors raise. Other operations may stay quiet (indexing a CPU
    tensor with a meta index does; masks and copies vary between torch releases), which is why every
    test also compares the values with a plain run."""
    cpu = torch.randn(4, 4)
    with torch.device("meta"):
        forgot, told = torch.arange(4), torch.arange(4, device="cpu")
        follows = torch.zeros_like(cpu)
    assert forgot.is_meta and told.device.type == "cpu" and follows.device.type == "cpu"
    must_raise = {
        "add": lambda: cpu + forgot.float(),
        "mul": lambda: cpu * forgot.float(),
        "cat": lambda: torch.cat((cpu[0], forgot.float())),
        "matmul": lambda: cpu @ forgot.float(),
    }
    assert [name for name, op in must_raise.items() if not _raises(op)] == []
    assert not _raises(lambda: cpu.index_select(0, forgot[:2]))  # quiet: the value comparison catches it


# -- the paths of the first table -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_rope_shift_of_a_snapshot_equals_recomputation(device, handles):
    def path(h: ModelHandle) -> Result:
        snap = h.prefill(PROMPT).snapshot
        shifted = snap.with_positions(torch.arange(37, 37 + snap.seq_len, device="cpu"))
        fresh = h.prefill(PROMPT, start_position=37).snapshot
        assert shifted.device == h.device
        bound = rope_angle_tol(torch.float32, 37 + snap.seq_len, fresh.keys) + forward_tol(h, fresh.keys)
        assert max_abs_diff(shifted.keys, fresh.keys) <= bound
        return {"keys": list(shifted.keys)}

    on_device(device, handles, path)


@pytest.mark.parametrize("device", DEVICES)
def test_rolling_cache_under_generate_rolls(device, handles):
    def path(h: ModelHandle) -> Result:
        cache = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4)
        out = _generate(h, _ids(h, PROMPT[:20]), cache, 30)
        assert cache.rolls >= 5
        return {"tokens": out.sequences[0].tolist(), "logits": torch.stack(out.logits)}

    on_device(device, handles, path)


@pytest.mark.parametrize("device", DEVICES)
def test_press(device, handles):
    def path(h: ModelHandle) -> Result:
        return {
            "tokens": Press("snapkv", compression_ratio=0.5).generate(h, PROMPT, MORE[:6], max_new_tokens=8)
        }

    on_device(device, handles, path)


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_a_snapshot_onto_the_models_device(device, handles, tmp_path):
    files = iter(range(10))

    def path(h: ModelHandle) -> Result:
        snap = h.prefill(PROMPT).snapshot
        file = save_snapshot(snap, tmp_path / f"snap-{next(files)}.safetensors")
        loaded = load_snapshot(file, model=h)  # model= implies its device
        assert loaded.device == h.device and loaded.is_prefill
        assert load_snapshot(file).device.type == "cpu"  # without a model: the host, as before
        assert load_snapshot(file, device=h.device).device == h.device
        assert loaded.token_ids.device.type == loaded.positions.device.type == "cpu"  # metadata: host
        cont = h.extend(loaded, MORE[:4])  # feeds the model as it comes back
        return {"keys": list(loaded.keys), "logits": cont.logits}

    on_device(device, handles, path)


@pytest.mark.parametrize("device", DEVICES)
def test_an_evicted_masked_snapshot_batched_with_the_full_cache(device, handles):
    """The eval's path: an eviction as a masked snapshot, stacked with the full cache, one batched
    forward and a batched greedy decode (the mask and the growing cache live on the model's device)."""

    def path(h: ModelHandle) -> Result:
        obs = observe(h, PROMPT)
        ev = evict(obs, make_policy("snapkv"), keep=0.5)
        assert all(m.device == h.device for m in ev.valid)
        fwd = h.forward([MORE[:4]] * 2, stack_rows([obs.snapshot, ev]), all_logits=False)
        rows = h.generate_rows(fwd.snapshot, fwd.logits[:, -1], 6)
        return {"logits": fwd.logits, "tokens": rows}

    on_device(device, handles, path)


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova", "knorm", "window", "random_sinks", "learned"])
@pytest.mark.parametrize("device", DEVICES)
def test_compressed_cache_with_an_eviction_policy(device, handles, policy):
    def path(h: ModelHandle) -> Result:
        cache = CompressedCache(h.config, policy=make_policy(policy), keep=0.5, model=h.model)
        logits = _decode(h, cache, PROMPT, MORE[:6])
        assert cache.held == 32 + 6
        return {"logits": logits}

    on_device(device, handles, path)


@pytest.mark.parametrize("share", ["heads=ada", "layers=pyramid"])
@pytest.mark.parametrize("device", DEVICES)
def test_live_shared_budgets(device, handles, share):
    """Per-head (ragged) and per-layer budgets in a live cache, under model.generate, on every device."""

    def path(h: ModelHandle) -> Result:
        from kvlab.policy.spec import cache_for

        cache = cache_for(f"snapkv,keep=0.5,{share}", h)
        out = _generate(h, _ids(h, PROMPT), cache, 8)
        return {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits), "bytes": cache.nbytes}

    on_device(device, handles, path)


@pytest.mark.parametrize(
    "spec", ["full", "sinks=2,window=16,chunk=4", "sinks=2,window=70,chunk=4,codec=kivi4,tail=4"]
)
@pytest.mark.parametrize("device", DEVICES)
def test_live_caches_from_a_spec(device, handles, spec):
    """Every kind of LiveCache that ``cache_for`` builds (FullCache, rolling, rolling over codes) under
    model.generate, on every device: tokens, logits and bytes held as on the CPU."""

    def path(h: ModelHandle) -> Result:
        from kvlab.policy.spec import cache_for

        cache = cache_for(spec, h)
        out = _generate(h, _ids(h, PROMPT), cache, 12)
        return {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits), "bytes": cache.nbytes}

    on_device(device, handles, path)


QUANTIZERS = {
    "rotation": RotatedQuantizer(bits=4, group_size=16, sinks=4),
    "kivi": KIVIQuantizer(bits=4, group_size=16, sinks=4, window=16),
    "pertoken": PerTokenQuantizer(bits=4, group_size=16),
}
# bound caches decode on the packed codes: "auto" is the C kernel on the CPU and torch ops on CUDA;
# "torch" runs the CUDA path on the CPU too (under the meta default, like every path here)
BINDINGS = ["unbound", "bound", "bound-torch"]


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize("method", list(QUANTIZERS))
@pytest.mark.parametrize("device", DEVICES)
def test_compressed_cache_with_a_quantizer(device, handles, method, binding):
    """Prompt and decode steps through a quantizing cache. On each device a bound cache's packed-code
    step equals attention over what the cache holds (decoded, then SDPA) within fp32 rounding. Across
    devices the caches quantize K/V that differ by fp32 rounding, so a value on a code boundary may take
    the neighbouring code on one device: the logits may then differ by a fraction of what quantization
    itself moves them (measured on the CPU run against a full-precision cache), and no more."""
    forced = binding == "bound-torch"

    def path(h: ModelHandle) -> Result:
        model = h.model if binding != "unbound" else None
        cache = CompressedCache(
            h.config, quantizer=QUANTIZERS[method], model=model, packed_path="torch" if forced else "auto"
        )
        logits = _decode(h, cache, PROMPT, MORE[:7])
        held = [layer.decoded() for layer in cache.layers]
        last = logits_after_layers(h, *map(tuple, zip(*held, strict=True)), MORE[7:8], len(PROMPT) + 7)[-1]
        logits = torch.cat((logits, _decode_more(h, cache, MORE[7:8])))
        assert max_abs_diff(logits[-1], last) <= forward_tol(h, last)  # the step reads what the cache holds
        if model is not None:
            want = "kernel" if h.device.type == "cpu" and not forced else "torch"
            assert cache.packed_steps == 8 and cache.packed_steps_by_path[want] == 8
        assert cache.layers[0].segments[0].keys.nbytes < 64 * 16 * 2  # really packed
        full = _decode(h, DynamicCache(config=h.config), PROMPT, MORE[:8])
        return {"logits": logits, "full_precision": full}

    def tol(cpu: Result) -> dict[str, float]:
        gap = max_abs_diff(cpu["logits"], cpu["full_precision"])
        return {"logits": forward_tol(handles["cpu"], cpu["logits"]) + gap}

    on_device(device, handles, path, tol=tol)


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("device", DEVICES)
def test_store_prefill_and_reuse_generate(device, handles, tier, tmp_path):
    roots = iter(range(10))

    def path(h: ModelHandle) -> Result:
        root = tmp_path / f"store-{next(roots)}"

        def store() -> KVStore:
            tiers = [MemoryTier()] + ([DiskTier(root)] if tier == "disk" else [])
            return KVStore(tiers, block_tokens=16)

        writer = store()
        prefill_with_store(h, writer, PROMPT)  # a miss: computed and stored
        reader = writer if tier == "memory" else store()  # a fresh process would read the disk tier
        hit = prefill_with_store(h, reader, PROMPT + MORE[:8])
        assert hit.cached_tokens == 64 and hit.match.tier_blocks == {tier: 4}
        assert hit.match.snapshot is not None and hit.match.snapshot.device == h.device
        gen = reuse_generate(h, reader, PROMPT + MORE[:12], max_new_tokens=5, stop_at_eos=False)
        assert gen.prefill.cached_tokens == 72
        return {"keys": list(hit.snapshot.keys), "logits": hit.last_logits, "tokens": gen.token_ids}

    on_device(device, handles, path)


@pytest.mark.parametrize("stream_path", ["masked", "loop"])
@pytest.mark.parametrize("device", DEVICES)
def test_stream_nll(device, handles, stream_path):
    def path(h: ModelHandle) -> Result:
        res = stream_nll(h, STREAM, "sinks2", window=16, feed=4, path=stream_path)
        assert res.extra["path"] == stream_path and res.extra["rolls"] >= 5
        return {"nll": torch.from_numpy(res.nll)}  # kvlab's per-token results are numpy (host)

    on_device(device, handles, path, host=("nll",))


def _left_padded(h: ModelHandle, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=h.device)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row, device=h.device)
        mask[r, width - len(row) :] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["rolling", "compressed-kivi", "compressed-h2o"])
@pytest.mark.parametrize("device", DEVICES)
def test_left_padded_batch_through_a_bound_cache(device, handles, kind):
    def path(h: ModelHandle) -> Result:
        if kind == "rolling":
            cache: Any = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4)
        elif kind == "compressed-kivi":
            cache = CompressedCache(h.config, quantizer=QUANTIZERS["kivi"], model=h.model)
        else:
            cache = CompressedCache(h.config, policy=make_policy("h2o"), keep=0.5, model=h.model)
        ids, mask = _left_padded(h, [PROMPT[:40], PROMPT[5:40], PROMPT[:23]])
        out = _generate(h, ids, cache, 12, mask)
        assert cache.rows is not None and len(cache.rows) == 3
        if kind == "compressed-kivi":  # later steps read codes (see the quantizer test): tokens, and the
            # prompt's logits (computed on full-precision K/V) within fp32 rounding
            return {"tokens": out.sequences.tolist(), "logits": out.logits[0]}
        return {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits)}

    on_device(device, handles, path)


def _autograd_path(kind: str, grad_before_last: bool) -> Callable[[ModelHandle], Result]:
    """Feed a prompt in pieces, then one token, through a live cache with autograd on; the gradient of the
    last logits reaches that token's input embedding and the output layer's weight. With
    ``grad_before_last`` every piece runs with autograd (the cache then holds tensors that require a
    gradient, and a rolling cache re-rotates them: what used to fail on ``out=``)."""

    def path(h: ModelHandle) -> Result:
        if kind == "rolling":
            cache: Any = RollingCache(
                h.config,
                h.rope,
                window=16,
                sinks=4,
                evict_chunk=4,
                max_position=h.max_positions,
                rebase="always",
            )
        elif kind == "compressed-rotation":
            cache = CompressedCache(h.config, quantizer=QUANTIZERS["rotation"])
        else:
            cache = CompressedCache(h.config, policy=make_policy("h2o"), keep=0.5, model=h.model)
        emb = h.model.get_input_embeddings()
        pieces = [PROMPT[:16], PROMPT[16:24], PROMPT[24:32], PROMPT[32:33], PROMPT[33:34]]
        choosing = getattr(cache, "choosing_positions", contextlib.nullcontext)  # a rolling cache re-bases
        for i, piece in enumerate(pieces):
            with torch.set_grad_enabled(grad_before_last or i == len(pieces) - 1), choosing():
                x = emb(_ids(h, piece)).detach().requires_grad_(True)
                out = h.model(inputs_embeds=x, use_cache=True, **{cache_argument(h.model): cache})
        if kind == "rolling":
            assert cache.rolls >= 3 and cache.rebases >= 3
        loss = out.logits[0, -1].float().pow(2).mean()
        gx, gw = torch.autograd.grad(loss, [x, h.model.get_output_embeddings().weight])
        assert float(gx.abs().sum()) > 0 and bool(torch.isfinite(gw).all())
        return {"logits": out.logits.detach(), "grad_input": gx, "grad_weight": gw}

    return path


@pytest.mark.parametrize("kind", ["rolling", "compressed-rotation", "compressed-h2o"])
@pytest.mark.parametrize("device", DEVICES)
def test_autograd_through_a_live_cache(device, handles, kind):
    """Gradients through a cache that has rolled (or quantized, or evicted) equal the gradients when only
    the last step had autograd on (the cache's contents are the same values either way)."""
    got = on_device(device, handles, _autograd_path(kind, grad_before_last=True))
    plain = _autograd_path(kind, grad_before_last=False)(handles[device])
    for name in ("grad_input", "grad_weight"):
        bound = forward_tol(handles[device], plain[name], layers=2 * handles[device].facts.num_layers)
        assert max_abs_diff(got[name], plain[name]) <= bound, name


@pytest.fixture(scope="module")
def slid_handles() -> dict[str, ModelHandle]:
    """A tiny Gemma-3 (layer 0 slides over 64 tokens, layer 1 attends to all) on every device."""
    from kvlab.model.facts import load_config_file
    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    h = tiny_random_model(load_config_file(config_path("gemma3")))
    out = {"cpu": h}
    for device in DEVICES[1:]:
        model = copy.deepcopy(h.model).to(device)
        out[device] = ModelHandle(model, h.tokenizer, name=h.name, weights_digest=h.weights_digest())
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_sliding_window_model_past_its_window(device, slid_handles):
    """Past the window, a snapshot keeps every slot and each forward masks the sliding layer on the slots'
    positions (the mask is built from host positions: it must reach the data's device), a live batch
    decodes on it, and an eviction keeps part of the sliding layer's window."""
    ids = STREAM + MORE + PROMPT[:46]  # 150 tokens: past the window of 64

    def path(h: ModelHandle) -> Result:
        past = h.prefill(ids[:100]).snapshot
        ext = h.extend(past, ids[100:]).logits
        with h.live_rows([past], room=60) as live:
            fed = live.feed(ids[100:])
            answer = live.greedy(fed[:, -1], 8)[0]
        o = observe(h, ids[:100])
        kept = evict(o, make_policy("tova"), keep=0.5)  # the observation carries the model's windows
        after = h.extend(kept, ids[100:104]).logits
        return {"extend": ext, "live": fed[0], "answer": answer, "held": kept.held_slots, "after": after}

    on_device(device, slid_handles, path)


def test_every_device_present_is_tested():
    """The device list is what this machine has: CUDA runs here exactly when torch sees a GPU."""
    assert DEVICES[0] == "cpu" and ("cuda" in DEVICES) == torch.cuda.is_available()
