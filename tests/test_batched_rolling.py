"""The server's cache mechanics, exactly: a batched decode step over rolling caches of different lengths
equals each cache's own step (through rolls and re-bases), and seeding a cache with a prefix's K/V
equals feeding that prefix."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf import batch
from kvlab.hf.batch import step_rolling_rows
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.hf.step import KVLAB_ATTENTION, open_step
from kvlab.streaming.generate import feed
from tests.tolerances import forward_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 200, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3-scaling"])
def test_batched_step_equals_each_rows_own_step_through_rolls_and_rebases(tiny_model, family):
    h = tiny_model(family)
    prompts = _prompts((3, 40, 90))

    def caches():  # a small maximum position so the caches re-base as well as roll
        return [rolling_cache_for(h, window=32, sinks=4, evict_chunk=8, max_position=160) for _ in prompts]

    alone, batched = caches(), caches()
    logits = torch.stack([feed(h, c, p) for c, p in zip(alone, prompts, strict=True)])
    for c, p in zip(batched, prompts, strict=True):
        feed(h, c, p)
    tokens = [int(t) for t in logits.argmax(-1)]
    worst = 0.0
    for _ in range(150):
        want = torch.stack([feed(h, c, [t]) for c, t in zip(alone, tokens, strict=True)])
        got = step_rolling_rows(h, batched, tokens)
        worst = max(worst, float((got - want).abs().max()) / forward_tol(h, want))
        tokens = [int(t) for t in want.argmax(-1)]
    assert worst <= 1.0, worst
    for a, b in zip(alone, batched, strict=True):
        assert (a.rolls, a.rebases, a.next_position, a.kept) == (b.rolls, b.rebases, b.next_position, b.kept)
        assert a.rolls >= 5 and a.rebases >= 1
        for (ka, va), (kb, vb) in zip(a.kept_layers(), b.kept_layers(), strict=True):
            tol = forward_tol(h, [ka, va])
            assert (ka - kb).abs().max() <= tol and (va - vb).abs().max() <= tol


def test_batched_step_refuses_what_it_cannot_do(tiny_model):
    h = tiny_model("llama")
    a, b = (rolling_cache_for(h, window=32, sinks=4, evict_chunk=8) for _ in range(2))
    feed(h, a, [5, 6, 7])
    with pytest.raises(BadInputError, match="hold a prompt"):
        step_rolling_rows(h, [a, b], [1, 2])
    with pytest.raises(BadInputError, match="twice"):
        step_rolling_rows(h, [a, a], [1, 2])
    with pytest.raises(BadInputError, match="one token per cache"):
        step_rolling_rows(h, [a], [1, 2])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_seeding_a_prefix_equals_feeding_it(tiny_model, family):
    h = tiny_model(family)
    prefix, rest = _prompts((30, 60), seed=3)
    fed = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
    seeded = rolling_cache_for(h, window=32, sinks=4, evict_chunk=8)
    feed(h, fed, prefix)
    snap = h.prefill(prefix).snapshot
    seeded.seed(list(zip(snap.keys, snap.values, strict=True)))
    want, got = feed(h, fed, rest), feed(h, seeded, rest)  # 60 more tokens: the caches roll
    assert fed.rolls >= 1 and (fed.rolls, fed.next_position) == (seeded.rolls, seeded.next_position)
    assert (want - got).abs().max() <= forward_tol(h, want)
    with pytest.raises(BadInputError, match="empty"):
        seeded.seed(list(zip(snap.keys, snap.values, strict=True)))
    long = h.prefill(_prompts((40,))[0]).snapshot
    with pytest.raises(BadInputError, match="sinks \\+ window"):
        rolling_cache_for(h, window=32, sinks=4, evict_chunk=8).seed(
            list(zip(long.keys, long.values, strict=True))
        )


def test_a_forward_that_bypasses_the_rows_attention_is_refused(tiny_model, monkeypatch):
    """If the model never calls kvlab's attention function, its logits would come from each row's new
    token alone: the step must refuse rather than return them."""
    h = tiny_model("llama")
    caches = [rolling_cache_for(h, window=32, sinks=4, evict_chunk=8) for _ in range(2)]
    for c, p in zip(caches, _prompts((5, 9)), strict=True):
        feed(h, c, p)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, KVLAB_ATTENTION, sdpa_attention_forward)
    with pytest.raises(UnsupportedModelError, match="attention interface"):
        step_rolling_rows(h, caches, [1, 2])
    assert h.model.config._attn_implementation != KVLAB_ATTENTION  # switched back after the failure


def test_another_threads_forward_never_reads_a_steps_caches(tiny_model):
    """While one thread's batched step is active (the model switched to the rows attention), a forward on
    another thread computes plain attention over its own input, not the step's caches."""
    import threading

    h = tiny_model("llama")
    caches = [rolling_cache_for(h, window=32, sinks=4, evict_chunk=8) for _ in range(2)]
    for c, p in zip(caches, _prompts((5, 9)), strict=True):
        feed(h, c, p)
    ids = torch.tensor([_prompts((12,), seed=5)[0]])
    want = h.run(ids).logits
    before = h.model.config._attn_implementation
    got: list[torch.Tensor] = []
    close = open_step(h.model, batch.RowsCache(caches))
    try:
        worker = threading.Thread(target=lambda: got.append(h.run(ids).logits))
        worker.start()
        worker.join(60)
    finally:
        close()
    assert h.model.config._attn_implementation == before
    assert len(got) == 1 and (got[0] - want).abs().max() <= forward_tol(h, want)
