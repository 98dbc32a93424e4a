"""Perplexity over a stream: how much does each cache policy lose against full context?

Every method reads the same token ids and returns the NLL of every token it predicts, so methods
compare on identical targets. Streaming methods score what a :class:`~kvlab.hf.rolling_cache.RollingCache`
fed ``feed`` tokens per forward lets each query see: the sinks, the last ``window`` tokens (give or
take one eviction chunk) and the earlier tokens of its own chunk. By default that is computed in a
few masked forwards (:mod:`kvlab.streaming.masked`, about one forward pass per method); ``path="loop"``
feeds the cache itself, the reference the masked path is tested against.

Methods (``name -> what``):
  ``full``        the whole prefix (only where it fits in the model's positions);
  ``window``      last ``window`` tokens, re-positioned from 0 at every roll (StreamingLLM's "window attention");
  ``window_abs``  last ``window`` tokens at their original positions (no re-positioning);
  ``sinks{s}``    ``s`` sink tokens + the window (StreamingLLM);
  ``recompute``   sliding window with re-computation: each target re-prefilled from its ``window``
                  previous tokens (exact, slow; run on a subsample of targets).

Where ``full`` runs, :func:`streaming_perplexity` also keeps its logits and every other method is
scored against them as it runs (no extra forward): per target, ``KL(full || method)`` in nats
(float64, :func:`kvlab.metrics.divergence.token_kl`) and top-1 agreement (``StreamResult.kl``, ``.top1``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.hf.masked import accepts_mask_per_layer_type
from kvlab.hf.rolling_cache import Rebase, RollingCache
from kvlab.metrics.divergence import token_kl, top1_agreement
from kvlab.metrics.logits import nll
from kvlab.metrics.stats import Interval
from kvlab.model.handle import ModelHandle, ModelLike, as_handle
from kvlab.rope.layers import sliding_windows
from kvlab.streaming.masked import evicted_before, masked_rolling_nll


@dataclass(frozen=True)
class StreamMethod:
    name: str
    sinks: int = 0
    rebase: Rebase = "auto"
    kind: str = "rolling"  # "rolling" | "full" | "recompute" | "policy" (a --cache spec)
    label: str = ""
    policy: Any = None  # the CachePolicy of a "policy" method


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


def policy_method(spec: str) -> str:
    """The streaming method scoring cache policy ``spec`` (:func:`kvlab.policy.spec.parse`), registered
    in :data:`METHODS` under its canonical spec (the name to pass to :func:`stream_nll`). Sinks + a window
    in full precision is scored by the masked single pass where that is exact (the rolling methods' path);
    a codec or a scored layout by feeding the live cache :func:`kvlab.policy.cache_for` builds."""
    from kvlab.policy.spec import parse

    policy = parse(spec)
    if policy.spec not in METHODS or METHODS[policy.spec].kind == "policy":
        METHODS[policy.spec] = StreamMethod(policy.spec, kind="policy", label=policy.spec, policy=policy)
    return policy.spec


@dataclass
class StreamResult:
    """Per-token NLL of one method: ``nll[i]`` is the NLL of token ``targets[i]`` (an index into the ids).

    With a reference (the ``full`` method's logits), ``kl[i]`` is ``KL(full || this method)`` in nats of
    the distribution over token ``targets[i]`` and ``top1[i]`` 1.0 where both argmaxes agree; ``logits``
    holds this method's own logits ``[n, vocab]`` only when asked for (``keep_logits``)."""

    method: str
    targets: np.ndarray  # [n] int indices into the token stream
    nll: np.ndarray  # [n] nats
    seconds: float
    tokens_processed: int
    extra: dict = field(default_factory=dict)
    kl: np.ndarray | None = None  # [n] nats (float64), against the reference
    top1: np.ndarray | None = None  # [n] 1.0 / 0.0
    logits: torch.Tensor | None = field(default=None, repr=False)

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


class _LogitsTap:
    """Sees each forward's logits ``[k, vocab]`` for query rows ``rows`` (query ``i`` predicts token
    ``i + 1``): keeps them (``keep``) and/or scores them against ``reference [n - 1, vocab]`` (the full
    method's logits for the same queries): per-token KL in float64 and top-1 agreement, ``block`` rows
    at a time (float64 copies of a large vocabulary stay small)."""

    block: int = 64

    def __init__(self, reference: torch.Tensor | None, keep: bool):
        self.reference, self.keep = reference, keep
        self.kept: list[torch.Tensor] = []
        self.kl: list[torch.Tensor] = []
        self.top1: list[torch.Tensor] = []

    def __call__(self, rows: torch.Tensor, logits: torch.Tensor) -> None:
        if self.keep:
            self.kept.append(logits.float())
        if self.reference is not None:
            rows = torch.as_tensor(rows, device=self.reference.device)
            for i in range(0, rows.shape[0], self.block):
                a, b = self.reference[rows[i : i + self.block]], logits[i : i + self.block]
                self.kl.append(token_kl(a, b).cpu())
                self.top1.append(top1_agreement(a, b).cpu())

    def fill(self, result: StreamResult) -> StreamResult:
        if self.keep:
            result.logits = torch.cat(self.kept)
        if self.reference is not None:
            result.kl, result.top1 = torch.cat(self.kl).numpy(), torch.cat(self.top1).numpy()
        return result


def _rolling_nll(
    handle: ModelHandle,
    ids: torch.Tensor,
    window: int,
    method: StreamMethod,
    feed: int,
    evict_chunk: int,
    on_chunk: Callable[[int], None] | None,
    on_logits: _LogitsTap | None = None,
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
    return _cache_loop_nll(handle, ids, cache, feed, on_chunk, on_logits)


def _canonical(method: str) -> str:
    """A method's name, a cache spec (anything not a method with ``=``, ``,`` or ``:``, or ``int<bits>``)
    registered and named by its canonical spec."""
    if method not in METHODS and (any(c in method for c in "=,:") or method.startswith("int")):
        return policy_method(method)
    return method


def _cache_loop_nll(
    handle: ModelHandle, ids: torch.Tensor, cache, feed: int, on_chunk, on_logits=None
) -> tuple[np.ndarray, dict]:
    """Feed ``ids`` ``feed`` tokens per forward through a live ``cache`` (a RollingCache, coded or not,
    or any cache :func:`kvlab.policy.cache_for` makes), scoring each next token; extra: the
    rolls, re-bases and largest position of a rolling cache, the K/V bytes held at the end and at most."""
    from kvlab.hf.policy_cache import held_bytes

    out, max_pos, peak = [], 0, 0
    rolling = isinstance(cache, RollingCache)
    for start in range(0, ids.shape[1] - 1, feed):
        chunk = ids[:, start : min(start + feed, ids.shape[1] - 1)]
        if rolling:
            max_pos = max(max_pos, cache.next_position + chunk.shape[1] - 1)
        logits = handle.run(chunk, cache).logits[0].float()
        out.append(nll(logits, ids[0, start + 1 : start + 1 + chunk.shape[1]]))
        peak = max(peak, held_bytes(cache))
        if on_logits:
            on_logits(torch.arange(start, start + chunk.shape[1], device="cpu"), logits)
        if on_chunk:
            on_chunk(chunk.shape[1])
    extra = {"rolls": cache.rolls, "rebases": cache.rebases, "max_position": max_pos} if rolling else {}
    return torch.cat(out).cpu().numpy(), {**extra, "held_bytes": held_bytes(cache), "peak_held_bytes": peak}


def _policy_nll(
    handle: ModelHandle, ids: torch.Tensor, method: StreamMethod, feed: int, path: str, on_chunk, tap
):
    """A ``--cache`` spec's NLL: sinks + window in full precision by the masked pass where exact (as the
    ``sinks{s}`` methods), anything else (a codec, a scored layout, full) through its live cache; a
    rolling layout without ``chunk=`` evicts ``feed`` at a time, as the other rolling methods do."""
    from kvlab.policy.spec import cache_for

    policy, n = method.policy, ids.shape[1]
    policy = replace(policy, layout=policy.layout.for_feed(feed))
    roll = policy.layout.rolls()
    masked = roll is not None and policy.codec is None and path != "loop"
    if masked and (path == "masked" or _masked_is_exact(handle, n)):
        return _masked_nll(handle, ids, roll.sinks, roll.window, feed, roll.chunk, on_chunk, tap)
    values, extra = _cache_loop_nll(handle, ids, cache_for(policy, handle), feed, on_chunk, tap)
    return values, {**extra, "path": "loop", "policy": policy.to_json()}


def _masked_nll(
    handle: ModelHandle, ids: torch.Tensor, sinks: int, window: int, feed: int, chunk: int, on_chunk, tap
):
    """A sinks + window stream's NLL by the masked single pass, and how many rolls it stood for."""
    values = masked_rolling_nll(
        handle, ids[0], sinks=sinks, window=window, feed=feed, evict_chunk=chunk, on_progress=on_chunk,
        on_logits=tap,
    )  # fmt: skip
    dropped = evicted_before(ids.shape[1] - 1, sinks=sinks, window=window, feed=feed, evict_chunk=chunk)
    return values, {"path": "masked", "rolls": int(np.unique(dropped[dropped > 0]).size)}


def _full_nll(handle: ModelHandle, ids: torch.Tensor, feed: int, on_chunk, on_logits=None) -> np.ndarray:
    from kvlab.hf.cache import new_hf_cache

    cache = new_hf_cache(handle.config)
    out = []
    step = max(feed, 256)
    for start in range(0, ids.shape[1] - 1, step):
        chunk = ids[:, start : min(start + step, ids.shape[1] - 1)]
        logits = handle.run(chunk, cache).logits[0].float()
        out.append(nll(logits, ids[0, start + 1 : start + 1 + chunk.shape[1]]))
        if on_logits:
            on_logits(torch.arange(start, start + chunk.shape[1], device="cpu"), logits)
        if on_chunk:
            on_chunk(chunk.shape[1])
    return torch.cat(out).cpu().numpy()


def _recompute_nll(
    handle: ModelHandle,
    ids: torch.Tensor,
    window: int,
    targets: np.ndarray,
    batch: int,
    on_chunk,
    on_logits=None,
) -> np.ndarray:
    """Each target ``t`` predicted from a fresh prefill of ``ids[t - window : t]`` (batched)."""
    out = []
    for i in range(0, len(targets), batch):
        ts = targets[i : i + batch]
        x = torch.stack([ids[0, t - window : t] for t in ts])
        logits = handle.run(x, logits_to_keep=1).logits[:, -1].float()
        out.append(nll(logits, ids[0, torch.as_tensor(ts, device=ids.device)]))
        if on_logits:
            on_logits(torch.as_tensor(ts, device="cpu") - 1, logits)
        if on_chunk:
            on_chunk(len(ts) * window)
    return torch.cat(out).cpu().numpy()


def _masked_is_exact(handle: ModelHandle, n: int) -> bool:
    """Where the masked path computes what the cache computes: RoPE that shifts exactly, every position
    of the stream within the model's range (the cache would re-base), and sliding-window layers only
    where each can get its own mask (all layers alike, or a decoder taking one mask per layer type)."""
    rope = handle.rope
    return (
        rope is not None
        and rope.shift_exact
        and (len(set(sliding_windows(handle.config))) == 1 or accepts_mask_per_layer_type(handle.model))
        and (not handle.max_positions or n <= handle.max_positions)
    )


@torch.no_grad()
def stream_nll(
    handle: ModelLike,
    token_ids: Sequence[int],
    method: str,
    *,
    window: int,
    feed: int = 16,
    evict_chunk: int | None = None,
    recompute_targets: Sequence[int] | np.ndarray | None = None,
    recompute_batch: int = 8,
    path: str = "auto",
    on_progress: Callable[[int], None] | None = None,
    reference: torch.Tensor | None = None,
    keep_logits: bool = False,
) -> StreamResult:
    """Per-token NLL of ``method`` over ``token_ids`` (targets 1..N-1, or ``recompute_targets``).

    ``reference`` ``[N - 1, vocab]``: the ``full`` method's logits (``keep_logits=True`` keeps them in
    ``StreamResult.logits``); with it, each target's KL to the reference and top-1 agreement are computed
    from the logits this method's forwards produce anyway (``StreamResult.kl``, ``.top1``).

    ``path`` (rolling methods): ``"masked"`` (a few masked forwards), ``"loop"`` (feed a RollingCache,
    the reference) or ``"auto"`` (masked where it is exact: a shift-exact RoPE, no sliding-window
    layers, the stream within the model's positions; the loop otherwise). ``extra["path"]`` says which ran.
    ``handle``: a :class:`~kvlab.model.ModelHandle` or a plain Hugging Face causal LM.
    """
    handle = as_handle(handle)
    method = _canonical(method)
    if method not in METHODS:
        raise BadInputError(f"unknown streaming method '{method}'; choose from {', '.join(METHODS)}")
    if path not in ("auto", "masked", "loop"):
        raise BadInputError(f"path must be 'auto', 'masked' or 'loop', got {path!r}")
    m = METHODS[method]
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=handle.device)[None]
    n = ids.shape[1]
    if n < 2:
        raise BadInputError("the text needs at least 2 tokens")
    if feed < 1:
        raise BadInputError(f"feed must be >= 1, got {feed}")
    if reference is not None and (reference.ndim != 2 or reference.shape[0] != n - 1):
        raise BadInputError(f"reference logits must be [{n - 1}, vocab], got {tuple(reference.shape)}")
    tap = _LogitsTap(reference, keep_logits) if reference is not None or keep_logits else None
    t0 = time.perf_counter()
    extra: dict = {}
    if m.kind == "full":
        if n > handle.max_positions:
            raise BadInputError(f"full context needs {n} positions, the model has {handle.max_positions}")
        values, targets, processed = _full_nll(handle, ids, feed, on_progress, tap), np.arange(1, n), n - 1
    elif m.kind == "policy":
        values, extra = _policy_nll(handle, ids, m, feed, path, on_progress, tap)
        targets, processed = np.arange(1, n), n - 1
    elif m.kind == "recompute":
        targets = np.asarray(
            recompute_targets if recompute_targets is not None else np.arange(window, n), dtype=np.int64
        )
        if targets.size == 0 or int(targets.min()) < window or int(targets.max()) >= n:
            raise BadInputError(f"recompute targets must lie in [{window}, {n}) (a full window before each)")
        values, processed = (
            _recompute_nll(handle, ids, window, targets, recompute_batch, on_progress, tap),
            targets.size * window,
        )
    else:
        chunk = evict_chunk or feed
        # "window" re-bases at every roll: it measures the cache's re-rotation itself, which a mask
        # cannot stand in for (in relative positions it is "window_abs"), so auto runs it in the cache
        use_mask = path == "masked" or (
            path == "auto" and m.rebase != "always" and _masked_is_exact(handle, n)
        )
        if use_mask:
            values, extra = _masked_nll(handle, ids, m.sinks, window, feed, chunk, on_progress, tap)
        else:
            values, extra = _rolling_nll(handle, ids, window, m, feed, chunk, on_progress, tap)
            extra["path"] = "loop"
        targets, processed = np.arange(1, n), n - 1
    result = StreamResult(
        method, targets, values.astype(np.float64), time.perf_counter() - t0, processed, extra
    )
    return tap.fill(result) if tap else result


def streaming_perplexity(
    handle: ModelLike,
    token_ids: Sequence[int],
    *,
    window: int,
    methods: Sequence[str] | None = None,
    feed: int = 16,
    recompute_samples: int = 64,
    recompute_stride: int | None = None,
    seed: int = 0,
    path: str = "auto",
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, StreamResult]:
    """Every method over the same stream; ``recompute`` on a subsample of targets >= window.

    The subsample is every ``recompute_stride``-th target from ``window`` on when a stride is given (a
    fixed, reproducible set: the benchmark's choice), else ``recompute_samples`` random targets.
    Every method scores all targets it can, so :meth:`StreamResult.ppl_on` compares identical targets.
    With ``full`` among the methods, ``full`` runs first and its logits are every
    method's reference (``StreamResult.kl``/``.top1``; ``full``'s own: KL to itself, 0, and top-1 1).
    """
    handle = as_handle(handle)
    methods = (
        [_canonical(m) for m in methods]
        if methods
        else [m for m in METHODS if m != "full" or len(token_ids) <= handle.max_positions]
    )
    n = len(token_ids)
    if n <= window + 1:
        raise BadInputError(
            f"the text has {n} tokens; streaming at window {window} needs more than {window + 1}"
        )
    sub = subsample_targets(n, window, samples=recompute_samples, stride=recompute_stride, seed=seed)
    reference, out = None, {}
    for name in sorted(methods, key=lambda m: m != "full"):  # full first: the others' reference
        out[name] = stream_nll(
            handle,
            token_ids,
            name,
            window=window,
            feed=feed,
            recompute_targets=sub,
            path=path,
            on_progress=on_progress,
            reference=reference,
            keep_logits=name == "full",
        )
        full_logits = out[name].logits
        if full_logits is not None:
            reference, out[name].logits = full_logits, None
            own = _LogitsTap(full_logits, keep=False)
            # the full context against itself: KL 0, top-1 1
            own(torch.arange(n - 1, device="cpu"), full_logits)
            own.fill(out[name])
    return {name: out[name] for name in methods}


def subsample_targets(
    n: int, window: int, *, samples: int = 64, stride: int | None = None, seed: int = 0
) -> np.ndarray:
    """Target indices ``>= window`` (a full window before each) for the re-computation baseline:
    every ``stride``-th from ``window`` on, or ``samples`` random ones (sorted) without a stride."""
    pool = np.arange(window, n)
    if stride is not None:
        if stride < 1:
            raise BadInputError(f"recompute stride must be >= 1, got {stride}")
        return pool[::stride].copy()
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(pool, size=min(samples, pool.size), replace=False))


# Columns of the streaming-perplexity table, shared by the ``streaming_ppl`` experiment and
# ``benchmarks/rolling.py`` so the study report and the benchmark read the same way.
TABLE_COLUMNS = [
    "text",
    "window",
    "method",
    "ppl (all targets)",
    "ppl (subsample)",
    "95% CI",
    "x re-computation (paired)",
    "95% CI ",
    "seconds",
    "tokens/s",
    "computed by",
]


def _divergence_cells(r: StreamResult, window: int, seed: int) -> dict:
    """Mean KL to the full context (nats) and top-1 agreement over the targets from ``window`` on (where
    a rolling cache may have evicted), with 95% intervals over those targets (bootstrap for KL, Wilson
    for top-1, a proportion); {} without a reference."""
    from kvlab.metrics import bootstrap_ci, wilson_ci

    if r.kl is None or r.top1 is None:
        return {}
    past = r.targets >= window
    if not past.any():
        return {}
    return {
        "kl_to_full": bootstrap_ci(r.kl[past], "mean", seed=seed).to_json(),
        "top1_to_full": wilson_ci(r.top1[past]).to_json(),
    }


def summarize(results: dict[str, StreamResult], source: str, window: int, seed: int = 0) -> list[dict]:
    """One row per method: perplexity on all targets and on the re-computation subsample, and the
    paired ratio to re-computation on that subsample (exp of the mean NLL difference) with bootstrap
    95% intervals; where the methods carry a reference (:func:`streaming_perplexity` with ``full``),
    ``kl_to_full`` and ``top1_to_full`` (interval dicts, over the targets from ``window`` on). Needs a
    ``"recompute"`` result."""
    from kvlab.metrics import bootstrap_ci

    if "recompute" not in results:
        raise BadInputError("summarize needs the 'recompute' method (the paired baseline)")
    sub, rec_nll = results["recompute"].targets, results["recompute"].nll
    rows = []
    for name, r in results.items():
        pos = {int(t): i for i, t in enumerate(r.targets)}
        sub_nll = r.nll[[pos[int(t)] for t in sub]]
        ci = bootstrap_ci(sub_nll, "mean", seed=seed)
        diff = bootstrap_ci(sub_nll - rec_nll, "mean", seed=seed)
        rows.append(
            {
                "source": source,
                "window": window,
                "method": name,
                "ppl_all": r.ppl,
                "ppl_subsample": float(np.exp(ci.value)),
                "ppl_subsample_low": float(np.exp(ci.low)),
                "ppl_subsample_high": float(np.exp(ci.high)),
                "ratio_to_recompute": float(np.exp(diff.value)),
                "ratio_low": float(np.exp(diff.low)),
                "ratio_high": float(np.exp(diff.high)),
                "seconds": r.seconds,
                "tokens_per_s": r.tokens_processed / r.seconds if r.seconds else float("nan"),
                "targets": int(r.targets.size),
                "subsample": int(sub.size),
                **dict(r.extra),
                **_divergence_cells(r, window, seed),
                **_ratio_to_fp_window(results, name, window, seed),
            }
        )
    return rows


def _fp_window_of(results: dict[str, StreamResult], name: str, window: int) -> str | None:
    """The full-precision sinks + window of the same sinks and window as cache spec ``name`` among
    ``results`` (itself a spec, or ``sinks{s}`` at the run's ``window``); None if there is none."""
    m = METHODS.get(results[name].method)
    if m is None or m.kind != "policy" or m.policy.codec is None:
        return None
    lay = m.policy.layout
    roll = lay.rolls()
    if roll is None:
        return None
    for other, r in results.items():
        o = METHODS.get(r.method)
        if o is not None and o.kind == "policy" and o.policy.codec is None and o.policy.layout == lay:
            return other
    legacy = f"sinks{roll.sinks}"
    return legacy if legacy in results and roll.window == window and not roll.chunk else None


def _ratio_to_fp_window(results: dict[str, StreamResult], name: str, window: int, seed: int) -> dict:
    """For a coded sinks + window spec: exp(mean paired NLL difference) to the full-precision sinks +
    window of the same layout in the run, over every target both scored, with a bootstrap 95% interval."""
    from kvlab.metrics import bootstrap_ci

    ref = _fp_window_of(results, name, window)
    if ref is None:
        return {}
    a, b = results[name], results[ref]
    common, ia, ib = np.intersect1d(a.targets, b.targets, return_indices=True)
    diff = bootstrap_ci(a.nll[ia] - b.nll[ib], "mean", seed=seed)
    return {
        "fp_window_method": ref,
        "ratio_to_fp_window": float(np.exp(diff.value)),
        "ratio_to_fp_window_low": float(np.exp(diff.low)),
        "ratio_to_fp_window_high": float(np.exp(diff.high)),
        "paired_targets": int(common.size),
    }


def table_row(row: dict) -> list:
    """A :func:`summarize` row as the cells of :data:`TABLE_COLUMNS` (numbers left for the renderer; an
    interval over fewer than 5 subsampled targets is written "(n = 3, no interval)")."""
    n = row["subsample"]
    return [
        row["source"],
        row["window"],
        METHODS[row["method"]].label,
        row["ppl_all"],
        row["ppl_subsample"],
        Interval(row["ppl_subsample"], row["ppl_subsample_low"], row["ppl_subsample_high"], n).bracket(".2f"),
        row["ratio_to_recompute"],
        Interval(row["ratio_to_recompute"], row["ratio_low"], row["ratio_high"], n).bracket(".3f"),
        row["seconds"],
        row["tokens_per_s"],
        {"masked": "masked forwards", "loop": "a live cache (the loop)"}.get(
            row.get("path", ""), "forward passes"
        ),
    ]
