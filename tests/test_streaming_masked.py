"""The masked single-pass evaluation of a rolling cache equals feeding the cache itself, per token.

The token loop (a real :class:`RollingCache` fed ``feed`` tokens per forward) is the reference; the
masked path rebuilds what each query sees (sinks re-positioned before the window, chunked eviction)
in a few forwards. Equal within fp32 rounding of two equal forward passes, on tiny models of every
RoPE family and on the bundled model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.streaming import stream_nll
from kvlab.streaming.masked import evicted_before, masked_rolling_nll
from tests.tolerances import forward_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stream(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def nll_tol(h, ids: list[int]) -> float:
    """NLL = logsumexp(logits) - logit: off by at most twice the logits' rounding bound."""
    return 2 * forward_tol(h, h.prefill(ids[:64]).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi", "llama3-scaling", "mistral"])
@pytest.mark.parametrize(
    "method,feed,chunk,block",
    [("sinks4", 16, 16, 64), ("sinks1", 5, 8, 37), ("sinks2", 1, 4, 100), ("window_abs", 7, 3, 50)],
)
def test_masked_equals_the_rolling_cache_token_for_token(tiny_model, family, method, feed, chunk, block):
    h = tiny_model(family)
    ids = stream(260)
    ref = stream_nll(h, ids, method, window=32, feed=feed, evict_chunk=chunk, path="loop")
    assert ref.extra["rolls"] >= 5
    sinks = {"sinks4": 4, "sinks1": 1, "sinks2": 2, "window_abs": 0}[method]
    got = masked_rolling_nll(
        h, torch.tensor(ids), sinks=sinks, window=32, feed=feed, evict_chunk=chunk, block=block
    )
    assert got.shape == ref.nll.shape
    err, tol = float(np.abs(got - ref.nll).max()), nll_tol(h, ids)
    assert err <= tol, f"max |dNLL| {err:.3g} > {tol:.3g}"


def test_a_wrong_visibility_is_caught(tiny_model):
    """The comparison can fail: one sink fewer, or the sinks left at their original positions, moves
    the NLL far past the tolerance."""
    h = tiny_model("llama")
    ids = stream(200, seed=3)
    ref = stream_nll(h, ids, "sinks4", window=24, feed=4, evict_chunk=4, path="loop").nll
    fewer = masked_rolling_nll(h, torch.tensor(ids), sinks=3, window=24, feed=4, evict_chunk=4)
    assert float(np.abs(fewer - ref).max()) > 100 * nll_tol(h, ids)
    other_chunk = masked_rolling_nll(h, torch.tensor(ids), sinks=4, window=24, feed=4, evict_chunk=8)
    assert float(np.abs(other_chunk - ref).max()) > 100 * nll_tol(h, ids)


def test_the_schedule_is_the_caches_own(tiny_model):
    """``evicted_before`` replays the cache's bookkeeping: the evictions seen by every fed token equal
    the tokens the real cache has dropped when that token is fed."""
    h = tiny_model("qwen2")
    ids = stream(150, seed=1)
    for sinks, window, feed, chunk in [(4, 20, 3, 5), (0, 16, 16, 16), (2, 30, 1, 7)]:
        cache = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk, rebase="never")
        seen = []
        for start in range(0, len(ids) - 1, feed):
            piece = ids[start : min(start + feed, len(ids) - 1)]
            plan = cache.plan.drop
            dropped = cache.tokens_seen - cache.slots + plan
            seen += [dropped] * len(piece)
            h.run(torch.tensor([piece]), cache)
        want = evicted_before(len(ids) - 1, sinks=sinks, window=window, feed=feed, evict_chunk=chunk)
        assert seen == want.tolist()


@pytest.mark.real_model
def test_bundled_model_masked_equals_loop(smollm):
    ids = smollm.encode("It was a dark and stormy night; the rain fell in torrents. " * 30)[:400]
    ref = stream_nll(smollm, ids, "sinks4", window=64, feed=16, path="loop")
    got = stream_nll(smollm, ids, "sinks4", window=64, feed=16)  # auto: masked on this model
    assert got.extra["path"] == "masked" and ref.extra["rolls"] == got.extra["rolls"] >= 5
    err, tol = float(np.abs(got.nll - ref.nll).max()), nll_tol(smollm, ids)
    assert err <= tol, f"max |dNLL| {err:.3g} > {tol:.3g}"


def test_auto_path_choice_and_bad_input(tiny_model):
    h = tiny_model("llama")
    ids = stream(120, seed=2)
    assert stream_nll(h, ids, "sinks2", window=32).extra["path"] == "masked"
    assert stream_nll(h, ids, "window_abs", window=32).extra["path"] == "masked"
    # "window" re-bases at every roll: what it measures is the cache's re-rotation, so it runs there
    assert stream_nll(h, ids, "window", window=32).extra["path"] == "loop"
    assert stream_nll(h, ids, "sinks2", window=32, path="loop").extra["path"] == "loop"
    with pytest.raises(BadInputError, match="path must be"):
        stream_nll(h, ids, "sinks2", window=32, path="fast")
    with pytest.raises(BadInputError, match="at least 2 tokens"):
        masked_rolling_nll(h, torch.tensor([5]), sinks=2, window=8, feed=1, evict_chunk=1)


@pytest.mark.parametrize("family", ["mistral-sw16", "gemma3"])
@pytest.mark.parametrize("method,feed,chunk", [("sinks4", 5, 8), ("window_abs", 3, 4), ("sinks2", 1, 6)])
def test_sliding_window_layers_masked_equal_the_loop_with_a_cache_larger_than_the_window(
    tiny_model, family, method, feed, chunk
):
    """Mistral with a 16-token window (every layer slides) and Gemma-3 (local layers slide over 64,
    global layers do not) under a rolling cache of 4 + 96 slots: the sliding layers see only their own
    window (transformers' slot-distance mask in the cache; the position-distance mask here)."""
    if family == "mistral-sw16":
        from kvlab.model.facts import load_config_file
        from kvlab.model.random import tiny_random_model
        from tests.conftest import config_path

        cfg = load_config_file(config_path("mistral"))
        cfg.sliding_window = 16
        h = tiny_random_model(cfg)
    else:
        h = tiny_model(family)
    ids = stream(300, seed=5)
    ref = stream_nll(h, ids, method, window=96, feed=feed, evict_chunk=chunk, path="loop")
    assert ref.extra["rolls"] >= 5
    sinks = {"sinks4": 4, "sinks2": 2, "window_abs": 0}[method]
    got = masked_rolling_nll(h, torch.tensor(ids), sinks=sinks, window=96, feed=feed, evict_chunk=chunk)
    # (snapshots stop below the window: the rounding bound comes from a 12-token prefill)
    err, tol = float(np.abs(got - ref.nll).max()), 2 * forward_tol(h, h.prefill(ids[:12]).logits)
    assert err <= tol, f"max |dNLL| {err:.3g} > {tol:.3g}"
    # path="auto" now takes the masked path on these models
    assert stream_nll(h, ids, method, window=96, feed=feed, evict_chunk=chunk).extra["path"] == "masked"
