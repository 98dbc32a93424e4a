"""Batches in model.generate with kvlab's caches: equal-length rows behave exactly like each row alone;
a padded batch is refused by every cache that drops slots (a wrong row returned as right is the bug
this guards), and runs unchanged through caches that keep every slot (quantization only)."""

from __future__ import annotations

import pytest
import torch

from kvlab.compress.evict import SnapKV, StreamingLLM
from kvlab.compress.quant import KIVIQuantizer
from kvlab.errors import BadInputError
from kvlab.hf import cache_argument
from kvlab.hf.compressed_cache import CompressedCache
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate(h, ids, cache, n, mask=None):
    with torch.no_grad():
        return h.model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **{cache_argument(h.model): cache},
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


def test_padded_batch_is_refused_before_the_cache_is_touched(tiny_model):
    h = tiny_model("llama")
    ids, mask = left_padded(rows(2, [20, 15, 3]))
    cache = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4, rebase="never")
    with pytest.raises(BadInputError, match="padded batch"):
        generate(h, ids, cache, 10, mask)
    assert cache.tokens_seen == 0 and not cache.layers[0].is_initialized
    # the same cache then serves a valid request
    generate(h, ids[:1], cache, 5)
    assert cache.tokens_seen == 20 + 4


@pytest.mark.parametrize("policy", [StreamingLLM(), SnapKV(window=4, observe=4)], ids=lambda p: p.name)
def test_padded_batch_is_refused_by_evicting_compressed_caches(tiny_model, policy):
    h = tiny_model("llama")
    ids, mask = left_padded(rows(3, [20, 12]))
    cache = CompressedCache(h.config, policy=policy, keep=0.5, model=h.model)
    try:
        with pytest.raises(BadInputError, match="padded batch"):
            generate(h, ids, cache, 5, mask)
    finally:
        cache.close()


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
