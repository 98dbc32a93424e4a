"""Batches in model.generate with kvlab's caches: equal-length rows behave exactly like each row alone;
a left-padded batch through a bound RollingCache (``rolling_cache_for``) runs each row on its own
cache and equals each row alone, token for token, through many rolls and re-bases; caches that cannot
keep rows apart refuse a padded batch (an unbound RollingCache, evicting CompressedCaches: a wrong row
returned as right is the bug this guards), and caches that keep every slot (quantization) run it."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.hf.step import THREAD
from kvlab.policy.evict import H2O, TOVA, KeyNorm, RandomPolicy, SlidingWindow, SnapKV, StreamingLLM
from kvlab.policy.quant import KIVIQuantizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate(h, ids, cache, n, mask=None, min_new=0, **extra):
    with torch.no_grad():
        return h.model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            max_new_tokens=n,
            min_new_tokens=min_new,  # > 0: no row stops at EOS, so every row runs every roll
            do_sample=False,
            pad_token_id=0,
            **{cache_argument(h.model): cache},
            **extra,
        )


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


def rows(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_equal_length_batch_rolls_like_each_row_alone(tiny_model, family):
    h = tiny_model(family)
    prompts = rows(1, [14, 14, 14])
    batch = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4, rebase="never")
    out = generate(h, torch.tensor(prompts), batch, 40)
    assert batch.rolls >= 5
    for r, p in enumerate(prompts):
        alone = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4, rebase="never")
        assert generate(h, torch.tensor([p]), alone, 40)[0].tolist() == out[r].tolist()


# Gemma-3: hybrid RoPE and 64-token sliding layers (the 100-token prompts pass them, so the per-row
# prefill applies the sliding window); SmolLM3: a layer without RoPE.
FAMILIES = ["llama", "qwen2", "mistral", "phi", "llama3-scaling", "gemma3", "smollm3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_equals_each_row_alone_through_rolls_and_rebases(tiny_model, family):
    """Issue 14's bar: a batch of 3 with 0, 5 and 17 pads; each row keeps its own first tokens as sinks,
    its own positions and its own roll and re-base schedule, as it would alone."""
    h = tiny_model(family, layers=4) if family == "smollm3" else tiny_model(family)
    prompts = rows(3, [100, 95, 83])
    ids, mask = left_padded(prompts)
    assert (mask == 0).sum(1).tolist() == [0, 5, 17]
    kw = dict(window=16, sinks=2, evict_chunk=4, max_position=120)  # every row re-bases
    batch = rolling_cache_for(h, **kw)
    out = generate(h, ids, batch, 40, mask, min_new=40)
    assert batch.rows is not None and len(batch.rows) == 3
    for r, p in enumerate(prompts):
        alone = rolling_cache_for(h, **kw)
        want = generate(h, torch.tensor([p]), alone, 40, min_new=40)[0, len(p) :]
        assert out[r, ids.shape[1] :].tolist() == want.tolist(), r
        row = batch.rows[r]
        assert (row.rolls, row.rebases, row.next_position) == (
            alone.rolls,
            alone.rebases,
            alone.next_position,
        )
        assert row.rolls >= 3 and row.rebases >= 1
    # rows re-based at their own times (row 0 holds 17 more tokens): their positions differ
    assert batch.rows[0].next_position != batch.rows[2].next_position


def test_padded_rows_logits_equal_each_row_alone(tiny_model):
    """The same at the logit level (fp32 tolerance: a batched matmul sums in another order)."""
    h = tiny_model("llama")
    prompts = rows(7, [22, 9, 15])
    ids, mask = left_padded(prompts)
    logits = dict(output_logits=True, return_dict_in_generate=True)
    got = generate(
        h, ids, rolling_cache_for(h, window=8, sinks=2, evict_chunk=2), 20, mask, min_new=20, **logits
    )
    for r, p in enumerate(prompts):
        alone = generate(
            h,
            torch.tensor([p]),
            rolling_cache_for(h, window=8, sinks=2, evict_chunk=2),
            20,
            min_new=20,
            **logits,
        )
        worst = max(float((a[r] - b[0]).abs().max()) for a, b in zip(got.logits, alone.logits, strict=True))
        assert worst < 1e-4, (r, worst)


def test_padded_batch_is_refused_by_an_unbound_rolling_cache_before_it_is_touched(tiny_model):
    """Without the binding nothing can keep the rows apart: refused, and the cache stays usable."""
    h = tiny_model("llama")
    ids, mask = left_padded(rows(2, [20, 15, 3]))
    cache = RollingCache(h.config, h.rope, window=16, sinks=2, evict_chunk=4, rebase="never")
    with pytest.raises(BadInputError, match="padded batch"):
        generate(h, ids, cache, 10, mask)
    assert cache.tokens_seen == 0 and not cache.layers[0].is_initialized
    # the same cache then serves a valid request
    generate(h, ids[:1], cache, 5)
    assert cache.tokens_seen == 20 + 4


def test_right_padding_and_a_row_of_pads_are_refused(tiny_model):
    h = tiny_model("llama")
    ids, mask = left_padded(rows(2, [12, 6]))
    for bad in (mask.flip(-1), torch.cat([mask[:1], torch.zeros_like(mask[:1])])):
        cache = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4)
        with pytest.raises(BadInputError, match="left-padded"):
            generate(h, ids, cache, 4, bad)
        assert cache.rows is None and cache.tokens_seen == 0
        assert THREAD.calls == []  # the refusal came from the forward hook; its bookkeeping is balanced


POLICIES = [
    SlidingWindow(),
    StreamingLLM(),
    SnapKV(window=4, observe=4),
    H2O(),
    TOVA(),
    KeyNorm(),
    RandomPolicy(seed=3),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_padded_batch_through_each_eviction_policy_equals_each_row_alone(tiny_model, policy):
    """A CompressedCache given the model runs a left-padded batch row by row: each row scores its own
    tokens with its own queries (pads stripped) and keeps its own budget, exactly as alone."""
    h = tiny_model("llama")
    prompts = rows(3, [40, 35, 23])
    ids, mask = left_padded(prompts)
    assert (mask == 0).sum(1).tolist() == [0, 5, 17]
    cache = CompressedCache(h.config, policy=policy, keep=0.5, model=h.model)
    out = generate(h, ids, cache, 20, mask, min_new=20)
    assert cache.rows is not None
    for r, p in enumerate(prompts):
        alone = CompressedCache(h.config, policy=policy, keep=0.5, model=h.model)
        try:
            want = generate(h, torch.tensor([p]), alone, 20, min_new=20)[0, len(p) :]
        finally:
            alone.close()
        assert out[r, ids.shape[1] :].tolist() == want.tolist(), r
        assert cache.rows[r].layers[0].held == alone.layers[0].held  # the row's own budget
    assert len({c.layers[0].held for c in cache.rows}) == 3


def test_padded_batch_is_refused_by_an_evicting_cache_without_the_model(tiny_model):
    h = tiny_model("llama")
    ids, mask = left_padded(rows(3, [20, 12]))
    cache = CompressedCache(h.config, policy=StreamingLLM(), keep=0.5)  # no model: nothing to run rows on
    with pytest.raises(BadInputError, match="padded batch"):
        generate(h, ids, cache, 5, mask)


def test_padded_batch_through_a_quantizing_cache_keeps_the_pads_masked(tiny_model):
    """Quantization keeps every slot, so transformers' padding mask still lines up: a padded batch is
    allowed, and with no quantized segment yet (all within the full-precision tail and sinks) each
    row equals the row alone through a plain cache."""
    h = tiny_model("llama")
    prompts = rows(4, [9, 5])
    ids, mask = left_padded(prompts)
    q = KIVIQuantizer(bits=4, group_size=8, window=64, sinks=0)
    out = generate(h, ids, CompressedCache(h.config, quantizer=q), 8, mask)
    for r, p in enumerate(prompts):
        alone = generate(h, torch.tensor([p]), CompressedCache(h.config), 8)
        assert out[r, ids.shape[1] :].tolist() == alone[0, len(p) :].tolist()


def test_rows_at_one_position_are_not_mistaken_for_padding(tiny_model):
    """A batch whose mask has no pads gives every row the same positions: not refused."""
    h = tiny_model("qwen2")
    ids = torch.tensor(rows(5, [6, 6]))
    cache = RollingCache(h.config, h.rope, window=8, sinks=2, evict_chunk=2, rebase="never")
    out = generate(h, ids, cache, 12)
    assert out.shape == (2, 18) and cache.rolls > 0
