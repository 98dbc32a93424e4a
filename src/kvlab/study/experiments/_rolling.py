"""Shared machinery of the rolling-window study (not an experiment itself: the leading ``_`` hides it).

The expensive part of the long-context experiments is one prefill per roll amount. One set of
prefills serves roll-vs-truncate (R3/R4), terminal de-rotation (R6), the de-rotation modes (R5) and
the RoPE predictor (B3), so :func:`long_roll_measure` computes every metric in one pass and keeps
only compact arrays, memoised per process: ``kvlab study`` pays for the prefills once.

Layout of one measurement: ``P_n = prefill(ids[s + n : s + L])`` for every roll ``n`` (``P_0`` is the
original). A window of the study is ``ids[s : s + e]`` for an *end* ``e`` in ``ends`` (each
>= ``context``). By causality, the window rolled by n is the prefix of ``P_n`` up to token ``s+e``,
and the window truncated by m is the prefix of ``P_0`` up to ``s+e-m``: so one prefill per n gives
the last-position comparison for every end, and truncation costs nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.data import Text, default_long_text, python_docs, read_text_file
from kvlab.errors import BadInputError
from kvlab.metrics.similarity import CacheComparison, PreparedCache, compare_caches
from kvlab.metrics.spectral import rope_pair_energy
from kvlab.study.experiments.base import ExperimentContext, Progress

SMALL_ROLLS = (1, 2, 3, 5, 10, 20)
FULL_ARRAY_ROLLS = (1, 5, 20)
SKIP_FRONT_TOKENS = 512
BUGGY_MAX_ROLL = 20


def derotated(c: CacheComparison) -> np.ndarray:
    """The de-rotated K cosines of a comparison that asked for them between two RoPE caches."""
    if c.cos_k_derotated is None:
        raise ValueError("no de-rotated K cosines: the caches have no RoPE or de-rotation was not asked for")
    return c.cos_k_derotated


# -- text -----------------------------------------------------------------------------------------


def study_text(ctx: ExperimentContext, text: str | Path | None = None) -> Text:
    """``--text FILE`` when given (the argument, else the study's options), else Frankenstein (shared
    data) or the Python docs. Reads the options, never writes them."""
    from kvlab.study.experiments._sampling import seeded_text

    path = text if text is not None else ctx.options.get("text")
    return seeded_text(read_text_file(path) if path else default_long_text(), ctx.seed)


def control_text(main: Text) -> Text:
    """Text for the unrelated control: the Python docs, or Frankenstein when the main text is the docs."""
    if main.source.startswith("Python documentation"):
        from kvlab.data import shared_book

        other = shared_book("frankenstein") or shared_book("pride_and_prejudice")
        if other is not None:
            return other
        return main  # same corpus: the caller takes a distant window
    return python_docs()


def encode_long(model: Any, text: Text, min_tokens: int, max_chars: int | None = None) -> list[int]:
    """Token ids of the text (at most ``max_chars`` characters), at least ``min_tokens`` of them."""
    chunk = text.text if max_chars is None else text.text[:max_chars]
    ids = model.encode(chunk)
    if len(ids) < min_tokens:
        raise BadInputError(
            f"{text.source} has {len(ids)} tokens; this experiment needs at least {min_tokens}"
        )
    return ids


def prefill_rows(model: Any, rows: list[list[int]], batch: int = 16) -> list[Any]:
    """Prefill equal-length token lists in batches; one single-row snapshot per list.

    Batching matters on CPU: a short prefill costs about as much as streaming the weights once, so
    20 windows in one pass are far cheaper than 20 passes. Rows never see each other (no padding).
    """
    if not rows:
        return []
    if len({len(r) for r in rows}) != 1:
        raise BadInputError("batched prefill needs token lists of equal length")
    out = []
    for i in range(0, len(rows), max(1, batch)):
        snap = model.prefill(rows[i : i + batch], all_logits=False).snapshot
        for b in range(snap.batch_size):
            out.append(
                snap.replace(
                    keys=tuple(k[b : b + 1] for k in snap.keys),
                    values=tuple(v[b : b + 1] for v in snap.values),
                    token_ids=snap.token_ids[b : b + 1],
                )
            )
    return out


# -- statistics -----------------------------------------------------------------------------------


def block_means(values: np.ndarray, blocks: int) -> np.ndarray:
    """Means of ``values [..., P]`` over ``blocks`` contiguous stretches of positions -> ``[blocks, ...]``.

    Neighbouring positions are correlated; a bootstrap over contiguous blocks (not single positions)
    keeps the interval honest.
    """
    p = values.shape[-1]
    edges = np.linspace(0, p, max(1, blocks) + 1).round().astype(int)
    empty = np.full(values.shape[:-1], np.nan)
    return np.stack(
        [
            values[..., a:b].mean(axis=-1) if b > a else empty
            for a, b in zip(edges[:-1], edges[1:], strict=True)
        ]
    )


# -- the long-context measurement -----------------------------------------------------------------


@dataclass(frozen=True)
class LongRollPlan:
    """Roll amounts ``ns`` (0 first), window length ``context``, window ``ends`` (>= context), start ``start``."""

    ns: tuple[int, ...]
    context: int
    ends: tuple[int, ...]
    start: int = 0
    blocks: int = 20

    @property
    def fine(self) -> int:
        """The last roll of the leading step-1 run (0, 1, 2, ...)."""
        k = 0
        while k + 1 < len(self.ns) and self.ns[k + 1] == k + 1:
            k += 1
        return k

    @property
    def span(self) -> int:
        return max(self.ends)

    def validate(self, available: int) -> None:
        if self.ns[0] != 0 or list(self.ns) != sorted(set(self.ns)):
            raise BadInputError("roll amounts must be sorted, distinct and start at 0 (the original)")
        if min(self.ends) < self.context:
            raise BadInputError("every window end must be at least the context length")
        if self.ns[-1] >= self.context:
            raise BadInputError(f"roll of {self.ns[-1]} >= the context of {self.context} tokens")
        if self.start + self.span > available:
            raise BadInputError(
                f"the text has {available} tokens, fewer than the {self.start + self.span} needed"
            )


def plan_for(
    ctx: ExperimentContext, available: int | None = None, context: int | None = None
) -> LongRollPlan:
    """The profile's plan: step-1 rolls up to ``fine``, then coarser steps up to ~90% of the context.

    ``context``: the argument, else the study's ``--context`` option, else the profile's size."""
    context = int(context or ctx.options.get("context") or ctx.pick(quick=384, default=1500, full=2000))
    fine = ctx.pick(quick=16, default=64, full=96)
    coarse_step = ctx.pick(quick=64, default=128, full=32)
    n_ends = ctx.pick(quick=4, default=20, full=20)
    end_step = 5
    if available is not None and available < context + end_step * (n_ends - 1):
        context = max(64, available - end_step * (n_ends - 1))
    fine = min(fine, context // 4)
    ns = list(range(0, fine + 1)) + list(range(fine + coarse_step, int(context * 0.9), coarse_step))
    ends = tuple(context + end_step * k for k in range(n_ends))
    # Skip the front matter (a book's table of contents repeats every few tokens) when the text allows.
    start = 0 if available is None else max(0, min(SKIP_FRONT_TOKENS, available - max(ends)))
    return LongRollPlan(
        ns=tuple(ns), context=context, ends=ends, start=start, blocks=ctx.pick(quick=8, default=20, full=20)
    )


_MEMO: dict[str, dict[str, np.ndarray]] = {}


def _key(model: Any, ids: list[int], plan: LongRollPlan) -> str:
    h = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes())
    h.update(repr((model.fingerprint, plan)).encode())
    return h.hexdigest()


def _allocate(plan: LongRollPlan, base: PreparedCache, rope: Any, L: int, H: int) -> dict[str, np.ndarray]:
    """The output arrays, NaN until measured, and the RoPE pair energies of the original keys."""
    T = plan.context
    ns, ends = np.asarray(plan.ns), np.asarray(plan.ends)
    N, E = len(ns), len(ends)
    out: dict[str, np.ndarray] = {"ns": ns, "ends": ends, "context": np.asarray(T)}
    metrics = ("k", "v", "kd", "kb") if rope is not None else ("k", "v")
    for m in metrics:
        out[f"roll_{m}_mean"] = np.full((N, L, H), np.nan)
        out[f"roll_{m}_mean_x1"] = np.full((N, L, H), np.nan)
        out[f"roll_{m}_blocks"] = np.full((N, plan.blocks), np.nan)
        out[f"roll_{m}_last"] = np.full((N, E, L, H), np.nan)
    for m in metrics[:3]:
        out[f"trunc_{m}_last"] = np.full((N, E, L, H), np.nan)
    out["per_position_k"] = np.full((N, T), np.nan)
    if rope is not None:
        out["per_position_kd"] = np.full((N, T), np.nan)
        out["energy_mean"] = rope_pair_energy(base.derotated_keys[:, :, :T], rope).mean(axis=2)
        last = torch.as_tensor(ends - 1, device=base.derotated_keys.device)
        out["energy_last"] = np.moveaxis(
            rope_pair_energy(base.derotated_keys.index_select(2, last), rope), 2, 0
        )
    return out


def _measure_roll(
    out: dict, j: int, n: int, base: PreparedCache, model: Any, ids: list[int], plan, rope
) -> None:
    """Roll ``n``: the rolled cache vs the original (means, blocks, last positions) and truncation by ``n``."""
    s, span, T = plan.start, plan.span, plan.context
    ends = np.asarray(plan.ends)
    rolled = PreparedCache(model.prefill(ids[s + n : s + span], all_logits=False).snapshot)
    idx_a, idx_b = np.arange(n, span), np.arange(0, span - n)
    c = compare_caches(
        base, rolled, idx_a, idx_b, derotate="correct" if rope is not None else "none", l2=False
    )
    vals = {"k": c.cos_k, "v": c.cos_v}
    if rope is not None:
        vals["kd"] = derotated(c)
        if n <= BUGGY_MAX_ROLL:  # the thread's mode, reproduced for the small rolls it studied
            vals["kb"] = derotated(compare_caches(base, rolled, idx_a, idx_b, derotate="buggy", l2=False))
    w = T - n  # aligned slots inside the window of length `context`
    for m, arr in vals.items():
        out[f"roll_{m}_mean"][j] = arr[..., :w].mean(-1)
        out[f"roll_{m}_mean_x1"][j] = arr[..., 1:w].mean(-1)
        out[f"roll_{m}_blocks"][j] = block_means(arr[..., :w].mean((0, 1)), plan.blocks)
        out[f"roll_{m}_last"][j] = np.moveaxis(arr[..., ends - 1 - n], -1, 0)
    out["per_position_k"][j, n:] = vals["k"][..., :w].mean((0, 1))
    if rope is not None:
        out["per_position_kd"][j, n:] = vals["kd"][..., :w].mean((0, 1))
    if n in FULL_ARRAY_ROLLS:
        for m in ("k", "v", "kd"):
            if m in vals:
                out[f"full_{m}_n{n}"] = vals[m][..., :w].astype(np.float32)
    t = compare_caches(
        base, base, ends - 1, ends - 1 - n, derotate="correct" if rope is not None else "none", l2=False
    )
    out["trunc_k_last"][j] = np.moveaxis(t.cos_k, -1, 0)
    out["trunc_v_last"][j] = np.moveaxis(t.cos_v, -1, 0)
    if rope is not None:
        out["trunc_kd_last"][j] = np.moveaxis(derotated(t), -1, 0)
    del rolled


def _identity(out: dict, j: int, metrics: tuple[str, ...], rope: Any) -> None:
    """Roll 0: every similarity is exactly 1."""
    for m in metrics:
        out[f"roll_{m}_mean"][j] = out[f"roll_{m}_mean_x1"][j] = 1.0
        out[f"roll_{m}_blocks"][j] = 1.0
        out[f"roll_{m}_last"][j] = 1.0
    for m in metrics[:3]:
        out[f"trunc_{m}_last"][j] = 1.0
    out["per_position_k"][j] = 1.0
    if rope is not None:
        out["per_position_kd"][j] = 1.0


def long_roll_measure(
    model: Any,
    ids: list[int],
    plan: LongRollPlan,
    progress: Progress | None = None,
    label: str = "long rolls",
) -> dict[str, np.ndarray]:
    """Every roll/truncate metric of the plan, ``[n, ...]`` arrays (memoised per process).

    Keys (``N = len(ns)``, ``E = len(ends)``, ``L`` layers, ``H`` KV heads):
    ``roll_{k,v,kd,kb}_mean [N, L, H]`` mean over the aligned slots of the window of length
    ``context`` (k raw, v, kd correctly de-rotated, kb the thread's buggy de-rotation, for n <= 20 only);
    ``roll_*_blocks [N, B]`` the same averaged over layers/heads per block of positions;
    ``roll_*_last [N, E, L, H]`` at the last position of each window end; ``trunc_{k,v,kd}_last [N, E, L, H]``
    the last slot of each window truncated by n against the original last slot; ``per_position_k``
    / ``per_position_kd`` ``[N, context]`` (NaN where a slot was rolled away); ``energy_mean [L, H, pairs+1]``
    and ``energy_last [E, L, H, pairs+1]`` the RoPE pair energies of the original de-rotated keys; and
    ``full_{k,v,kd}_n{n}`` ``[L, H, context - n]`` for n in (1, 5, 20).
    """
    plan.validate(len(ids))
    key = _key(model, ids, plan)
    if key in _MEMO:
        return _MEMO[key]
    s, span = plan.start, plan.span
    N = len(plan.ns)
    base_snap = model.prefill(ids[s : s + span], all_logits=False).snapshot
    base = PreparedCache(base_snap)  # converted and de-rotated once for every n
    rope = base_snap.rope
    L, H = base_snap.num_layers, base_snap.num_kv_heads
    out = _allocate(plan, base, rope, L, H)
    metrics = ("k", "v", "kd", "kb") if rope is not None else ("k", "v")
    with (progress or Progress()).task(label, total=N) as advance:
        for j, n in enumerate(np.asarray(plan.ns)):
            n = int(n)
            if n > 0:
                _measure_roll(out, j, n, base, model, ids, plan, rope)
            else:
                _identity(out, j, metrics, rope)
            advance(1)
    _MEMO[key] = out
    return out


# -- the thread's reference results -----------------------------------------------------------------


#: The thread's published numbers as kvlab ships them (the fields it reads from each result file).
REFERENCE_FILE = Path(__file__).resolve().parents[1] / "data" / "thread_reference.json"


@dataclass
class Reference:
    """The thread's Qwen2.5 result files (``files``, by the file's name without ``.json``) and the
    research brief's numbers that no file carries (``brief``), from :data:`REFERENCE_FILE`."""

    root: Path | None
    files: dict[str, Any] = field(default_factory=dict)
    brief: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Any:
        return self.files.get(name)

    @property
    def note(self) -> str:
        return (
            f"thread reference numbers (Qwen2.5) not found: {REFERENCE_FILE} is missing from this "
            "installation, so the overlay plots are skipped"
        )

    @property
    def source(self) -> str:
        return (
            "the thread's published Qwen2.5 result files, numbers as kvlab ships them "
            "(kvlab/study/data/thread_reference.json)"
        )


def reference() -> Reference:
    """The shipped copy of the thread's numbers: the one source every experiment compares against."""
    import json

    if not REFERENCE_FILE.is_file():
        return Reference(None)
    doc = json.loads(REFERENCE_FILE.read_text())
    return Reference(REFERENCE_FILE, doc["files"], doc["research_brief"])
