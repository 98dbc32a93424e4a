"""The ring is a storage kind, not another cache: its logits equal the dense rolling cache's.

The ring (:class:`~kvlab.hf.static_rolling.StaticRollingCache`, fixed buffers, a capturable step) and the
dense rolling cache :func:`~kvlab.hf.rolling_cache.rolling_cache_for` builds follow one rule (the same
sinks, window, chunk, re-bases), so every forward sees the same tokens at the same relative positions:
logits agree to fp32 rounding of RoPE at other absolute positions, step after step, through hundreds of
rolls and re-bases, eagerly and under ``torch.compile(fullgraph=True)``. Both report alike (one
:class:`~kvlab.hf.live_cache.LiveCache` interface).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from kvlab.hf.graphs import RollingDecoder
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.hf.static_rolling import static_rolling_cache_for

TOL = 2e-5  # fp32 logits of O(1): RoPE at other absolute positions moves keys by ~1e-7 relative
SINKS, WINDOW, CHUNK, STEPS = 2, 12, 2, 460  # a roll every 2 tokens: 220 rolls
ROLL = {"window": WINDOW, "sinks": SINKS, "evict_chunk": CHUNK, "max_position": 96}  # re-bases too


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_ring_logits_equal_the_dense_rolling_cache(mode, tiny_llama_2x64, one_torch_thread):
    """Prefill 10 tokens, then one token per step: every step's logits within 2e-5, the same counts,
    positions and kept K/V at the end, and the same report."""
    h = tiny_llama_2x64
    ids = torch.randint(0, 512, (STEPS,), generator=torch.Generator().manual_seed(0))
    dense, ring = rolling_cache_for(h, **ROLL), static_rolling_cache_for(h, **ROLL)
    dec = RollingDecoder(h, ring, mode=mode)  # type: ignore[arg-type]
    h.run(ids[:10], dense, logits_to_keep=1)
    dec.prefill(ids[:10])
    torch._dynamo.utils.counters.clear()
    worst = 0.0
    for t in range(10, STEPS):
        a = h.run(ids[t : t + 1], dense, logits_to_keep=1).logits[0, -1].float()
        worst = max(worst, float((a - dec.feed(ids[t : t + 1])[0]).abs().max()))
    assert worst < TOL
    if mode == "compile":  # one graph for every step, no breaks: the roll happens between steps
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert not torch._dynamo.utils.counters["graph_break"]
        assert dec.captures == 1
    assert dense.rebases == ring.rebases >= 5 and dense.rolls == ring.rolls >= 200
    for name in ("kept", "tokens_seen", "evictions", "next_position", "empty"):
        assert getattr(ring, name) == getattr(dense, name), name
    assert torch.equal(ring.positions(), dense.positions())
    for (k1, v1), (k2, v2) in zip(dense.kept_layers(), ring.kept_layers(), strict=True):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    assert ring.describe().split("(", 1)[1] == dense.describe().split("(", 1)[1]
    assert ring.is_compileable and not dense.is_compileable
    assert int(ring.nbytes) > 0 and ring.nbytes == ring.nbytes()
