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
