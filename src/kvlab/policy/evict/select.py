"""Keeping a budget: top-scored slots per KV head, sinks and recent window forced, and the result.

Invariants of :func:`evict`'s result (a masked :class:`~kvlab.cache.KVSnapshot`): every layer and KV
head holds exactly ``n_keep`` valid slots; the first ``sinks`` and last ``window`` slots of the policy
are among them; kept keys are untouched, at their original positions, so the next query goes at the
source's ``next_position``. :func:`repack` re-rotates them to ``0..n_keep-1`` per head instead.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError
from kvlab.policy.evict.observe import Observation
from kvlab.policy.evict.policies import LayerView, Policy
from kvlab.policy.window import SinksWindow
from kvlab.rope.ops import shift_keys


def budget_slots(length: int, keep: float | None = None, n_keep: int | None = None) -> int:
    """Slots to keep out of ``length``: a fraction ``keep`` in (0, 1] or an explicit count in [1, length]."""
    if (keep is None) == (n_keep is None):
        raise BadInputError("give exactly one budget: keep (a fraction in (0, 1]) or n_keep (a slot count)")
    if keep is not None:
        if not 0.0 < float(keep) <= 1.0:
            raise BadInputError(f"keep must be a fraction in (0, 1], got {keep}")
        return max(1, round(float(keep) * length))
    assert n_keep is not None  # exactly one of keep / n_keep, checked above
    if not 1 <= int(n_keep) <= length:
        raise BadInputError(f"n_keep must lie in [1, {length}] for a cache of {length} slots, got {n_keep}")
    return int(n_keep)


def check_budget(n_keep: int, t: int, sinks: int) -> None:
    """A budget of ``n_keep`` of ``t`` slots must lie in ``[1, t]`` and hold the ``sinks``."""
    if not 1 <= n_keep <= t:
        raise BadInputError(f"cannot keep {n_keep} of {t} slots; the budget must lie in [1, {t}]")
    if sinks > n_keep:
        raise BadInputError(f"the budget of {n_keep} slots is smaller than the {sinks} sinks asked for")


def keep_indices(scores: torch.Tensor, n_keep: int, sinks: int = 0, window: int = 0) -> torch.Tensor:
    """``[B, H, n_keep]`` sorted slot indices: the top-``n_keep`` of ``scores [B, H, T]`` per head.

    The first ``sinks`` slots are always kept (a budget smaller than ``sinks`` is an error); the last
    ``window`` slots are kept as far as the budget left after the sinks allows.
    """
    t = scores.shape[-1]
    check_budget(n_keep, t, sinks)
    s = scores.float().clone()
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, -1e30))
    # the protected slots are a SinksWindow's, with the window cut to what the budget leaves
    sink_end, window_start = SinksWindow(sinks, max(0, min(window, n_keep - min(sinks, t)))).bounds(t)
    bonus = torch.zeros(t, device=s.device)
    bonus[window_start:] = 1e35  # below the sinks' bonus, above any score
    bonus[:sink_end] = 1e36
    idx = torch.topk(s + bonus, n_keep, dim=-1).indices
    return idx.sort(dim=-1).values


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


def kept_per_head(
    snapshot: KVSnapshot,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The valid slots of a masked snapshot compacted per layer and KV head: ``keys``/``values``
    ``[B, H, n, D]`` and ``slots [B, H, n]`` (sorted), for a mask that keeps the same count ``n`` in
    every head of a layer (what :func:`evict` makes). New tensors; keys stay at their positions."""
    keys, values, slots = [], [], []
    for k, v, m in zip(snapshot.keys, snapshot.values, snapshot.valid_layers(), strict=True):
        counts = m.sum(dim=-1)
        n = int(counts.flatten()[0])
        if not bool((counts == n).all()):
            raise BadInputError(
                "the heads of a layer keep different numbers of slots; no compact [B, H, n] form"
            )
        idx = torch.sort(
            torch.where(m, torch.arange(m.shape[-1], device=m.device), m.shape[-1]), dim=-1
        ).values
        idx = idx[..., :n]
        keys.append(_gather(k, idx))
        values.append(_gather(v, idx))
        slots.append(idx)
    return tuple(keys), tuple(values), tuple(slots)


def repack(snapshot: KVSnapshot) -> KVSnapshot:
    """An evicted (masked) cache's kept slots compacted per head and their keys re-rotated to ``0..n-1``
    (an exact RoPE shift): what a cache that re-packs positions after evicting holds; the next query goes
    at ``n``. Heads keep different tokens at a packed slot, so ``token_ids`` are -1 there
    (:data:`kvlab.cache.snapshot.MIXED_TOKEN`) unless every layer and head agrees."""
    from kvlab.cache.snapshot import MIXED_TOKEN

    rope = snapshot.require_rope("re-packing kept keys' positions")
    keys, values, slots = kept_per_head(snapshot)
    n = keys[0].shape[-2]
    target = torch.arange(n, device=keys[0].device)
    out = []
    for i, (k, idx) in enumerate(zip(keys, slots, strict=True)):
        spec = rope.for_layer(i)
        pos = snapshot.positions.to(idx.device)[idx]
        out.append(k if spec is None else shift_keys(k, (target - pos).to(k.device), spec))
    ids = torch.stack(
        [snapshot.token_ids.to(s.device).gather(1, s[:, h]) for s in slots for h in range(s.shape[1])]
    )
    same = (ids == ids[:1]).all(dim=0)
    token_ids = torch.where(same, ids[0], torch.full_like(ids[0], MIXED_TOKEN)).cpu()
    return snapshot.replace(
        keys=tuple(out),
        values=values,
        token_ids=token_ids,
        positions=torch.arange(n, device="cpu"),
        valid=None,
        provenance="repositioned",
    )


def layer_views(source: KVSnapshot | Observation, policy: Policy | None = None) -> list[LayerView]:
    """One view per layer; an Observation's are built once and kept on it (their derived scores with them).

    With a ``policy`` that asks for an extra pass (:meth:`~kvlab.policy.evict.Policy.probe_ids`) and an
    Observation, the pass is run (once per Observation and tokens) and each view carries it (``probe``)."""
    views = _views(source)
    if policy is None or not isinstance(source, Observation):
        return views
    ids = policy.probe_ids(source.snapshot.token_ids[0].tolist(), source.tokenizer)
    if ids is None:
        return views
    probe = source.probe(ids)
    return [dataclasses.replace(v, probe=probe) for v in views]


def _views(source: KVSnapshot | Observation) -> list[LayerView]:
    queries: tuple[torch.Tensor | None, ...]
    if isinstance(source, Observation):
        if source.views:
            return source.views
        snap, queries, scaling = source.snapshot, source.queries, source.scaling
    elif isinstance(source, KVSnapshot):
        snap, queries, scaling = source, (None,) * source.num_layers, 1.0
    else:
        raise BadInputError(f"evict needs a KVSnapshot or an Observation, got {type(source).__name__}")
    windows = source.windows if isinstance(source, Observation) else ()
    views = [
        LayerView(
            i,
            snap.num_layers,
            k,
            v,
            snap.positions,
            queries[i],
            scaling,
            window=windows[i] if windows else None,
        )
        for i, (k, v) in enumerate(zip(snap.keys, snap.values, strict=True))
    ]
    if isinstance(source, Observation):
        source.views.extend(views)
    return views


def evict(
    source: KVSnapshot | Observation,
    policy: Policy,
    *,
    keep: float | None = None,
    n_keep: int | None = None,
    windows: tuple[int | None, ...] | None = None,
) -> KVSnapshot:
    """Keep a budget of slots per layer and KV head, chosen by ``policy``: a masked
    :class:`~kvlab.cache.KVSnapshot` (``source`` is not modified).

    Every layer and KV head holds exactly ``n_keep`` valid slots (its top scores, the policy's sinks and
    window forced); kept keys stay at their original positions and the next query goes at the source's
    ``next_position``, as in the live :class:`~kvlab.hf.compressed_cache.CompressedCache`.
    :meth:`~kvlab.model.ModelHandle.forward` runs the result; :attr:`~kvlab.cache.KVSnapshot.held_nbytes`
    is what a compacting cache keeps of it. Attention-based policies need an :class:`Observation` (from
    :func:`observe`); key-only policies also accept a plain snapshot.

    A model's sliding-window layers (``windows``: each layer's, None for full attention; an Observation
    carries its model's) hold only the slots the next token can see, the last ``window - 1``: there the
    budget is ``keep`` of those (``n_keep`` at most all of them), chosen among them by scores over each
    query's window, the policy's recent window kept and its sinks (out of sight) not.
    """
    views = layer_views(source, policy)
    snap = source.snapshot if isinstance(source, Observation) else source
    snap.require_unmasked("scoring slots for eviction")
    n = budget_slots(snap.seq_len, keep, n_keep)
    windows = (source.windows if isinstance(source, Observation) else ()) if windows is None else windows
    valid = []
    for view in views:
        window = windows[view.layer] if windows else None
        if window is None:
            idx = keep_indices(policy.score(view), n, policy.sinks, policy.window)
        else:
            idx = _keep_in_window(policy, view, snap, window, keep, n_keep)
        mask = torch.zeros(tuple(view.keys.shape[:3]), dtype=torch.bool, device=view.keys.device)
        valid.append(mask.scatter_(2, idx.to(mask.device), True))
    return snap.replace(valid=tuple(valid), provenance="edited")


def _keep_in_window(
    policy: Policy, view: LayerView, snap: KVSnapshot, window: int, keep: float | None, n_keep: int | None
) -> torch.Tensor:
    """A sliding layer's kept slots ``[B, H, n]``: its budget out of the slots within ``window`` of the next
    position (the last ones of a context whose positions rise), the rest dropped."""
    seen = (snap.next_position - snap.positions.cpu()) < window
    held = int(seen.sum())
    start = view.seq_len - held
    if not held or not bool(seen[start:].all()):
        raise BadInputError(
            "a sliding layer's eviction needs a context whose positions rise to its last slot"
        )
    n = budget_slots(held, keep) if keep is not None else min(int(n_keep or held), held)
    return keep_indices(policy.score(view)[..., start:], n, 0, policy.window) + start
