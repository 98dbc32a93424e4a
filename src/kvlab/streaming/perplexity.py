"""Perplexity over a stream: how much does each cache policy lose against full context?

Every method reads the same token ids and returns the NLL of every token it predicts, so methods
compare on identical targets. Streaming methods feed ``feed`` tokens per forward through a
:class:`~kvlab.hf.rolling_cache.RollingCache`; a query then sees the sinks, the last ``window``
tokens (give or take one eviction chunk) and the earlier tokens of its own chunk.

Methods (``name -> what``):
  ``full``        the whole prefix (only where it fits in the model's positions);
  ``window``      last ``window`` tokens, re-positioned from 0 at every roll (StreamingLLM's "window attention");
  ``window_abs``  last ``window`` tokens at their original positions (no re-positioning);
  ``sinks{s}``    ``s`` sink tokens + the window (StreamingLLM);
  ``recompute``   sliding window with re-computation: each target re-prefilled from its ``window``
                  previous tokens (exact, slow; run on a subsample of targets).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.hf.rolling_cache import RollingCache
from kvlab.metrics.logits import nll


@dataclass(frozen=True)
class StreamMethod:
    name: str
    sinks: int = 0
    rebase: str = "auto"
    kind: str = "rolling"  # "rolling" | "full" | "recompute"
    label: str = ""


METHODS: dict[str, StreamMethod] = {
    "full": StreamMethod("full", kind="full", label="full context"),
    "window": StreamMethod("window", sinks=0, rebase="always", label="window only (re-positioned)"),
    "window_abs": StreamMethod("window_abs", sinks=0, rebase="never", label="window only, no re-positioning"),
    **{
        f"sinks{s}": StreamMethod(f"sinks{s}", sinks=s, label=f"{s} sink{'s' if s > 1 else ''} + window")
        for s in (1, 2, 4, 8)
    },
    "recompute": StreamMethod("recompute", kind="recompute", label="sliding window, re-computed"),
}


def method_names() -> list[str]:
    return list(METHODS)


@dataclass
class StreamResult:
    """Per-token NLL of one method: ``nll[i]`` is the NLL of token ``targets[i]`` (an index into the ids)."""

    method: str
    targets: np.ndarray  # [n] int indices into the token stream
    nll: np.ndarray  # [n] nats
    seconds: float
    tokens_processed: int
    extra: dict = field(default_factory=dict)

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean())) if self.nll.size else float("nan")

    def ppl_on(self, targets: np.ndarray) -> float:
        """Perplexity restricted to ``targets`` (all must be among this method's targets)."""
        pos = {int(t): i for i, t in enumerate(self.targets)}
        missing = [int(t) for t in targets if int(t) not in pos]
        if missing:
            raise BadInputError(f"method {self.method} did not score targets {missing[:5]}...")
        return float(np.exp(self.nll[[pos[int(t)] for t in targets]].mean()))


def _rolling_nll(
    handle,
    ids: torch.Tensor,
    window: int,
    method: StreamMethod,
    feed: int,
    evict_chunk: int,
    on_chunk: Callable[[int], None] | None,
) -> tuple[np.ndarray, dict]:
    cache = RollingCache(
        handle.config,
        handle.rope,
        window=window,
        sinks=method.sinks,
        evict_chunk=evict_chunk,
        max_position=handle.max_positions,
        rebase=method.rebase,
    )
    out = []
    max_pos = 0
    for start in range(0, ids.shape[1] - 1, feed):
        chunk = ids[:, start : min(start + feed, ids.shape[1] - 1)]
        max_pos = max(max_pos, cache.next_position + chunk.shape[1] - 1)
        logits = handle.model(input_ids=chunk, past_key_values=cache, use_cache=True).logits[0].float()
        out.append(nll(logits, ids[0, start + 1 : start + 1 + chunk.shape[1]]))
        if on_chunk:
            on_chunk(chunk.shape[1])
    return torch.cat(out).numpy(), {"rolls": cache.rolls, "rebases": cache.rebases, "max_position": max_pos}


def _full_nll(handle, ids: torch.Tensor, feed: int, on_chunk) -> np.ndarray:
    from kvlab.hf.cache import new_hf_cache

    cache = new_hf_cache(handle.config)
    out = []
    step = max(feed, 256)
    for start in range(0, ids.shape[1] - 1, step):
        chunk = ids[:, start : min(start + step, ids.shape[1] - 1)]
        logits = handle.model(input_ids=chunk, past_key_values=cache, use_cache=True).logits[0].float()
        out.append(nll(logits, ids[0, start + 1 : start + 1 + chunk.shape[1]]))
        if on_chunk:
            on_chunk(chunk.shape[1])
    return torch.cat(out).numpy()


def _recompute_nll(
    handle, ids: torch.Tensor, window: int, targets: np.ndarray, batch: int, on_chunk
) -> np.ndarray:
    """Each target ``t`` predicted from a fresh prefill of ``ids[t - window : t]`` (batched)."""
    out = []
    for i in range(0, len(targets), batch):
        ts = targets[i : i + batch]
        x = torch.stack([ids[0, t - window : t] for t in ts])
        logits = handle.model(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        out.append(nll(logits, ids[0, torch.as_tensor(ts)]))
        if on_chunk:
            on_chunk(len(ts) * window)
    return torch.cat(out).numpy()


@torch.no_grad()
def stream_nll(
    handle,
    token_ids: Sequence[int],
    method: str,
    *,
    window: int,
    feed: int = 16,
    evict_chunk: int | None = None,
    recompute_targets: Sequence[int] | None = None,
    recompute_batch: int = 8,
    on_progress: Callable[[int], None] | None = None,
) -> StreamResult:
    """Per-token NLL of ``method`` over ``token_ids`` (targets 1..N-1, or ``recompute_targets``)."""
    if method not in METHODS:
        raise BadInputError(f"unknown streaming method '{method}'; choose from {', '.join(METHODS)}")
    m = METHODS[method]
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    n = ids.shape[1]
    if n < 2:
        raise BadInputError("the text needs at least 2 tokens")
    if feed < 1:
        raise BadInputError(f"feed must be >= 1, got {feed}")
    t0 = time.perf_counter()
    extra: dict = {}
    if m.kind == "full":
        if n > handle.max_positions:
            raise BadInputError(f"full context needs {n} positions, the model has {handle.max_positions}")
        values, targets, processed = _full_nll(handle, ids, feed, on_progress), np.arange(1, n), n - 1
    elif m.kind == "recompute":
        targets = np.asarray(
            recompute_targets if recompute_targets is not None else np.arange(window, n), dtype=np.int64
        )
        if targets.size == 0 or int(targets.min()) < window or int(targets.max()) >= n:
            raise BadInputError(f"recompute targets must lie in [{window}, {n}) (a full window before each)")
        values, processed = (
            _recompute_nll(handle, ids, window, targets, recompute_batch, on_progress),
            targets.size * window,
        )
    else:
        values, extra = _rolling_nll(handle, ids, window, m, feed, evict_chunk or feed, on_progress)
        targets, processed = np.arange(1, n), n - 1
    return StreamResult(
        method, targets, values.astype(np.float64), time.perf_counter() - t0, processed, extra
    )


def streaming_perplexity(
    handle,
    token_ids: Sequence[int],
    *,
    window: int,
    methods: Sequence[str] | None = None,
    feed: int = 16,
    recompute_samples: int = 64,
    seed: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, StreamResult]:
    """Every method over the same stream; ``recompute`` on ``recompute_samples`` random targets >= window."""
    methods = (
        list(methods)
        if methods
        else [m for m in METHODS if m != "full" or len(token_ids) <= handle.max_positions]
    )
    n = len(token_ids)
    if n <= window + 1:
        raise BadInputError(
            f"the text has {n} tokens; streaming at window {window} needs more than {window + 1}"
        )
    rng = np.random.default_rng(seed)
    pool = np.arange(window, n)
    sub = np.sort(rng.choice(pool, size=min(recompute_samples, pool.size), replace=False))
    return {
        name: stream_nll(
            handle, token_ids, name, window=window, feed=feed, recompute_targets=sub, on_progress=on_progress
        )
        for name in methods
    }
