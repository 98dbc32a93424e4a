"""Memory is the policy's: after a prefill of any length a rolling window holds what it keeps (``sinks +
window`` slots, plus one slot of room for a decode step and the sinks' original keys), not the prompt.

A feed longer than the cache's headroom (a prompt in one forward, ``model.generate``'s prefill) is
*settled* at the end of its own update (:meth:`kvlab.hf.rolling_cache.RollingLayer._settle`): its roll is
applied into buffers of the steady size, so the prompt-sized ones die with the forward. Every check of
bytes here is made twice: ``held_bytes`` (what the cache reports) and the bytes of the distinct storages
its tensors live in (what it really keeps alive: a slice of a prompt-sized tensor reports its own size).
The reference for exactness is the same cache with settling switched off (the roll then applied lazily,
at the next update, as before): logits are compared with ``torch.equal``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaForCausalLM

from kvlab.errors import BadInputError
from kvlab.hf import cache_argument
from kvlab.hf.coded_rolling import CodedRollingLayer
from kvlab.hf.policy_cache import held_bytes
from kvlab.hf.rolling_cache import RollingCache, RollingLayer, rolling_cache_for
from kvlab.policy.quant.methods import make_quantizer
from kvlab.policy.spec import cache_for
from kvlab.streaming.generate import feed

CACHE_ARG = cache_argument(LlamaForCausalLM)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def storage_bytes(cache) -> int:
    """Bytes of the distinct storages every tensor a cache's layers hold lives in (views count their whole
    storage once), found through the layers' attributes, lists and stored objects (segments, codes)."""
    seen: dict[int, int] = {}
    visited: set[int] = set()
    skip = {"rule", "rope", "codec", "query_module", "query_hook"}

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return
        if id(x) in visited or isinstance(x, torch.nn.Module):
            return
        visited.add(id(x))
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dict__"):
            for name, y in vars(x).items():
                if name not in skip:
                    walk(y)

    for layer in cache.layers:
        walk(layer)
    return sum(seen.values())


def slot_bytes(handle) -> int:
    """K and V bytes of one slot in every layer (fp32)."""
    c = handle.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def unsettled(monkeypatch):
    """Settling switched off: the previous behaviour (the roll applied at the next update), the reference."""

    def switch_off() -> None:
        monkeypatch.setattr(RollingLayer, "_settle", lambda self: None)
        monkeypatch.setattr(CodedRollingLayer, "_settle", lambda self: None)

    return switch_off


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize("spec", ["sinks=4,window=32", "sinks=0,window=32", "sinks=4,window=32,chunk=8"])
@torch.no_grad()
def test_a_long_prompt_leaves_the_window_not_the_prompt(llama, unsettled, spec):
    h = llama
    cache = cache_for(spec, h)
    sinks = 0 if spec.startswith("sinks=0") else 4
    bound = 1.1 * (sinks + 32) * slot_bytes(h)
    h.run(_ids(600), cache, logits_to_keep=1)
    assert cache.tokens_seen == 600 and cache.kept <= sinks + 32
    assert held_bytes(cache) <= bound and storage_bytes(cache) <= bound, (held_bytes(cache), bound)
    buffer = cache.layers[0]._buf_k.data_ptr()
    for t in range(96):  # three windows of decode steps: several rolls, no reallocation
        h.run(torch.tensor([[3 + t]]), cache, logits_to_keep=1)
        assert storage_bytes(cache) <= bound
    assert cache.rolls >= 4 and cache.layers[0]._buf_k.data_ptr() == buffer
    unsettled()  # the check can fail: without settling the prompt's buffers outlive its forward
    old = cache_for(spec, h)
    h.run(_ids(600), old, logits_to_keep=1)
    assert held_bytes(old) >= 600 * slot_bytes(h) and storage_bytes(old) >= 600 * slot_bytes(h)


def _coded(h, **kw):
    return RollingCache(
        h.config,
        h.rope,
        window=96,
        sinks=4,
        evict_chunk=32,
        codec=make_quantizer("kivi", 4, group_size=16),
        **kw,
    )


# (model, cache) pairs: plain windows, re-bases planned by the prompt's own roll (always; auto near a
# small maximum), no sinks, a hybrid model's sliding layers, a window over codes
CASES = {
    "window": ("llama", lambda h: RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8)),
    "rebase-always": (
        "llama",
        lambda h: RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8, rebase="always"),
    ),
    "rebase-near-max": (
        "llama",
        lambda h: RollingCache(h.config, h.rope, window=32, sinks=4, evict_chunk=8, max_position=420),
    ),
    "no-sinks": ("llama", lambda h: RollingCache(h.config, h.rope, window=32, sinks=0, evict_chunk=5)),
    "sliding-layers": (
        "gemma3",
        lambda h: RollingCache(h.config, h.rope, window=100, sinks=4, evict_chunk=8, rebase="always"),
    ),
    "codes": ("llama", lambda h: _coded(h, rebase="always")),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_settling_changes_no_logit(tiny_model, unsettled, case):
    """A 400-token prompt in one forward then 40 decode steps: every logit, the kept K/V and the counts
    equal the lazy roll's (settling off), bit for bit."""
    family, make = CASES[case]
    h = tiny_model(family)

    def run():
        cache = make(h)
        out = [h.run(_ids(400), cache).logits]
        settled = all(layer.settled for layer in cache.layers)
        held = storage_bytes(cache)
        out += [h.run(torch.tensor([[7 + t]]), cache).logits for t in range(40)]
        return cache, out, settled, held

    cache, got, settled, held = run()
    unsettled()
    ref_cache, want, _, ref_held = run()
    assert settled and held * 4 < ref_held  # it did settle, and kept far less than the prompt
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for (k, v), (rk, rv) in zip(cache.kept_layers(), ref_cache.kept_layers(), strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    state = (cache.rolls, cache.rebases, cache.next_position, cache.kept, cache.tokens_seen)
    assert state == (ref_cache.rolls, ref_cache.rebases, ref_cache.next_position, ref_cache.kept, 440)
    if case.startswith("rebase"):
        assert cache.rebases >= 1


@torch.no_grad()
def test_model_generate_with_rolling_cache_for_holds_the_window(llama, unsettled):
    """README's snippet: ``model.generate`` with ``rolling_cache_for``: after its prefill (one new token, so
    generate runs the prompt's forward only) the cache holds the window; the tokens equal the lazy roll's."""
    h = llama
    prompt = _ids(300, seed=3)
    bound = 1.1 * 36 * slot_bytes(h)
    cache = rolling_cache_for(h, window=32, sinks=4)
    h.model.generate(prompt, **{CACHE_ARG: cache}, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert cache.tokens_seen == 300 and held_bytes(cache) <= bound and storage_bytes(cache) <= bound

    def tokens() -> list[int]:
        c = rolling_cache_for(h.model, window=32, sinks=4)
        g = h.model.generate(prompt, **{CACHE_ARG: c}, max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert c.rolls >= 1 and storage_bytes(c) <= bound
        return g[0, 300:].tolist()

    got = tokens()
    unsettled()
    assert got == tokens()


@torch.no_grad()
def test_pieces_of_the_headroom_hold_at_most_one_piece_more_until_the_next_step(llama):
    """The stated exception: a prompt fed in pieces of at most the headroom (kvlab's ``feed``, the server)
    is not settled (its roll could be held between pieces); after the last piece the buffers hold at most
    kept + one piece, and the first decode step shrinks them to the steady size."""
    h = llama
    cache = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
    feed(h, cache, _ids(600)[0].tolist())
    assert storage_bytes(cache) <= (36 + cache.headroom) * slot_bytes(h) + 4 * slot_bytes(h) // 2
    h.run(torch.tensor([[5]]), cache)
    assert storage_bytes(cache) <= 1.1 * 36 * slot_bytes(h)
    assert cache.layers[0]._buf_k.shape[-2] == 36 + 1


@torch.no_grad()
def test_hold_roll_after_a_settled_prompt_is_refused(llama):
    """A settled roll cannot be held (its dropped slots are gone): refused, and the refusal changes nothing
    (the next step equals that of a cache never asked to hold)."""
    h = llama
    held, plain = (rolling_cache_for(h, window=32, sinks=4, evict_chunk=8) for _ in range(2))
    for cache in (held, plain):
        h.run(_ids(10), cache)
    held.hold_roll()  # a short piece: nothing settled, its (empty) roll is held
    for cache in (held, plain):
        h.run(_ids(300), cache)
    with pytest.raises(BadInputError, match="headroom"):
        held.hold_roll()
    step = torch.tensor([[5]])
    assert torch.equal(h.run(step, held).logits, h.run(step, plain).logits)


@torch.no_grad()
def test_a_checkpoint_puts_back_a_settled_forward(llama):
    """A checkpoint taken before a long feed restores the cache as it was (the settled buffers are new;
    the old ones are untouched): feeding the same again then equals a cache that never went back."""
    h = llama
    first, long = _ids(20, seed=1), _ids(300, seed=2)
    a = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
    b = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
    h.run(first, a)
    h.run(first, b)
    undo = a.checkpoint()
    h.run(_ids(300, seed=9), a)
    undo()
    got = [h.run(long, a).logits] + [h.run(torch.tensor([[t + 3]]), a).logits for t in range(12)]
    want = [h.run(long, b).logits] + [h.run(torch.tensor([[t + 3]]), b).logits for t in range(12)]
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("spec", ["h2o,budget=32", "snapkv,budget=32,heads=ada", "tova,budget=32,every=16"])
@torch.no_grad()
def test_a_scored_eviction_keeps_only_its_budget_after_a_long_prompt(llama, spec):
    """The scored layouts evict inside the prefill's update into tensors of their own (gathers): nothing
    prompt-sized stays behind (the positions, int64 per kept slot and head, are the extra)."""
    h = llama
    cache = cache_for(spec, h)
    h.run(_ids(600), cache, logits_to_keep=1)
    assert cache.kept <= 40
    assert storage_bytes(cache) <= 1.2 * cache.kept * slot_bytes(h)
    cache.close()


RSS_CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, sys
    import torch
    from transformers import LlamaConfig
    from kvlab.policy.spec import cache_for
    from kvlab.hf.policy_cache import held_bytes
    from kvlab.model.random import tiny_random_model

    def rss():
        gc.collect()
        try:  # glibc: hand freed heap pages back, so RSS shows what is still held
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    spec, n, settle = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "settle"
    if not settle:
        from kvlab.hf.rolling_cache import RollingLayer
        RollingLayer._settle = lambda self: None
    torch.set_num_threads(1)
    cfg = LlamaConfig(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                      intermediate_size=256, vocab_size=512, max_position_embeddings=16384,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    h = tiny_random_model(cfg, head_dim=64, layers=8, kv_heads=8)
    ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h.run(ids[:, :64], cache_for(spec, h), logits_to_keep=1)  # warm-up: kernels, allocator pools
        before = rss()
        cache = cache_for(spec, h)
        h.run(ids, cache, logits_to_keep=1)
        after = rss()
    print(json.dumps({"growth": after - before, "held": held_bytes(cache)}))
    """
)


@pytest.mark.slow
@pytest.mark.process
def test_process_memory_after_a_long_prompt_is_the_windows():
    """RSS, in fresh processes (8 layers x 8 KV heads of 64: 32 KiB a slot; a 4,000-token prompt holds
    131 MB in a full cache). RSS moves with the allocator, so the claim is relative: the full cache's
    run grows by at least 80% of what it holds (the measure sees a cache), the rolling window's by under
    10% of that, and the same window with settling off (the old behaviour) by at least 80% of it (the
    measure sees the difference settling makes)."""

    def run(spec: str, settle: bool) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, spec, "4000", "settle" if settle else "lazy"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    full = run("full", True)
    window = run("sinks=4,window=64", True)
    lazy = run("sinks=4,window=64", False)
    assert full["held"] == 4000 * 32768 and window["held"] <= 1.1 * 68 * 32768
    assert full["growth"] >= 0.8 * full["held"], full
    assert window["growth"] <= 0.1 * full["held"], (window, full)
    assert lazy["growth"] >= 0.8 * full["held"], (lazy, full)


@pytest.mark.real_model
@pytest.mark.slow
@torch.no_grad()
def test_the_bundled_model_after_an_8k_prompt_holds_its_260_slots(smollm):
    """The acceptance figure: ``cache_for("sinks=4,window=256")`` after one forward of an 8,000-token
    prompt (Python's docs) holds at most 1.1x the bytes of 260 slots (it held 30.8x before settling), and
    still does after decode steps."""
    from kvlab.data import python_docs

    ids = smollm.encode(python_docs().text)[:8000]
    assert len(ids) == 8000
    cache = cache_for("sinks=4,window=256", smollm)
    bound = 1.1 * 260 * slot_bytes(smollm)
    smollm.run(torch.tensor([ids]), cache, logits_to_keep=1)
    assert cache.tokens_seen == 8000 and cache.kept <= 260
    assert held_bytes(cache) <= bound and storage_bytes(cache) <= bound, held_bytes(cache) / (bound / 1.1)
    for t in range(3):
        smollm.run(torch.tensor([[ids[t]]]), cache, logits_to_keep=1)
    assert held_bytes(cache) <= bound and storage_bytes(cache) <= bound
