"""Plain Hugging Face objects work wherever a kvlab ModelHandle does: the rolling cache, streaming
perplexity and generation, the cache store, with the same results as through a handle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvlab
from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.store import open_store, prefill_with_store, reuse_generate
from kvlab.streaming import stream_generate, stream_nll
from kvlab.streaming.generate import feed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(8)).tolist()


def test_rolling_cache_and_stream_generate_from_a_plain_model(tiny_model):
    h = tiny_model("qwen2")
    plain = h.model  # a transformers PreTrainedModel, no kvlab wrapper
    a = rolling_cache_for(plain, window=16, sinks=2, evict_chunk=4)
    b = rolling_cache_for(h, window=16, sinks=2, evict_chunk=4)
    assert a.rule == b.rule  # same RoPE, same maximum
    first_a, first_b = feed(plain, a, IDS[:20]), feed(h, b, IDS[:20])
    assert torch.equal(first_a, first_b)
    got = [e.token_id for e in stream_generate(plain, a, first_a, 40)]
    assert got == [e.token_id for e in stream_generate(h, b, first_b, 40)] and a.rolls > 3


def test_stream_nll_from_a_plain_model(tiny_model):
    h = tiny_model("llama")
    for method in ("sinks2", "window"):
        x = stream_nll(h.model, IDS, method, window=24, feed=8)
        y = stream_nll(h, IDS, method, window=24, feed=8)
        assert np.array_equal(x.nll, y.nll) and x.extra["path"] == y.extra["path"]


def test_store_from_a_plain_model(tiny_model, tmp_path):
    h = tiny_model("llama")
    store = open_store(tmp_path / "s", block_tokens=16)
    first = prefill_with_store(h.model, store, IDS[:70])
    again = reuse_generate(h.model, store, IDS[:70] + [5, 6], 4)
    assert (
        first.match.cached_tokens == 0 and again.prefill.match.cached_tokens == 70
    )  # the whole stored prompt
    # a handle of the same model finds the same caches (same fingerprint, same namespace)
    assert store.namespace(h).root == store.namespace(h.model).root
    with pytest.raises(BadInputError, match="no tokenizer"):
        prefill_with_store(h.model, store, "text needs a tokenizer")


def test_wrapping_is_cached_and_refuses_what_is_not_a_model(tiny_model):
    h = tiny_model("llama")
    assert kvlab.as_handle(h) is h
    assert kvlab.as_handle(h.model) is kvlab.as_handle(h.model)  # the weights are hashed once
    with pytest.raises(BadInputError, match="Hugging Face causal LM"):
        kvlab.as_handle("smollm2")
    with pytest.raises(BadInputError, match="Hugging Face causal LM"):
        rolling_cache_for(object(), window=8)
