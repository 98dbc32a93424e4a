"""Suffix caching on snapshots: roll a context forward, keep the survivors' K/V, fix their positions.

A roll of ``drop=n`` with ``sinks=s`` keeps slots ``[0, s)`` (the attention sinks) and ``[s + n, T)``,
and re-positions the kept keys to be contiguous from the first position, so the result looks like
a prefill of ``sinks + rolled text``. Keys are re-rotated once from their stored positions
(:meth:`KVSnapshot.with_positions`, float64 angles), never incrementally.

The thread's variants are here by name (:data:`VARIANTS`) next to the exact references, plus
selective recompute: refresh some slots of a rolled cache exactly (the first ``k`` after the sinks,
or the ``k`` whose keys deviate most from a cheap probe; CacheBlend's idea applied to rolls).

Shapes: snapshots hold ``[batch, kv_heads, T, head_dim]`` per layer; slot indices are ``[k]`` ints.
Every function returns a new snapshot and leaves its input untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.ops.recompute import recompute_slots
from kvlab.policy.window import SinksWindow

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle


def roll(snapshot: KVSnapshot, drop: int, sinks: int = 0, *, reposition: bool = True) -> KVSnapshot:
    """Drop ``drop`` tokens after the first ``sinks`` and keep the rest (cached K and V).

    The roll is :class:`~kvlab.policy.SinksWindow` applied offline. With ``reposition`` (default) the
    kept keys are re-rotated to contiguous positions starting at the first slot's position (exact
    RoPE shift); without it they keep their original positions (queries then continue at the old
    ``next_position``). Raises for models without RoPE or with a RoPE whose frequencies depend on the
    length (dynamic NTK): re-prefill with :func:`reprefill_rolled` instead.
    """
    return SinksWindow.dropping(snapshot.seq_len, drop, sinks).apply(snapshot, reposition=reposition)


def rolled_ids(snapshot: KVSnapshot, drop: int, sinks: int = 0) -> list[int]:
    """Token ids of the rolled context (sinks + survivors)."""
    ids = snapshot.token_list()
    return [ids[i] for i in SinksWindow.dropping(len(ids), drop, sinks).kept(len(ids))]


def reprefill_rolled(handle: ModelHandle, snapshot: KVSnapshot, drop: int, sinks: int = 0) -> KVSnapshot:
    """The exact reference: a fresh prefill of the rolled text (``sinks + survivors``) from the first position.

    With ``sinks=0`` this is "re-prefill of the rolled text"; with sinks, "re-prefill of sinks + rolled text".
    """
    ids = rolled_ids(snapshot, drop, sinks)
    return handle.prefill(ids, start_position=int(snapshot.positions[0]), all_logits=False).snapshot


def simulated_roll(handle: ModelHandle, snapshot: KVSnapshot, drop: int, sinks: int = 0) -> KVSnapshot:
    """The thread's ``simulated_roll``: cached K shifted to the new positions + cached V (= :func:`roll`)."""
    return roll(snapshot, drop, sinks)


def k_ropefixed_v_rolled(handle: ModelHandle, snapshot: KVSnapshot, drop: int, sinks: int = 0) -> KVSnapshot:
    """The thread's ``k_ropefixed_v_rolled``: cached K shifted + V taken from a re-prefill of the rolled text."""
    k = roll(snapshot, drop, sinks)
    ref = reprefill_rolled(handle, snapshot, drop, sinks)
    return k.replace(values=ref.values, provenance="rolled")


def naive_slice(handle: ModelHandle, snapshot: KVSnapshot, drop: int, sinks: int = 0) -> KVSnapshot:
    """Kept slots with their original positions (no re-rotation); queries continue at the old positions."""
    return roll(snapshot, drop, sinks, reposition=False)


RollFn = Callable[[Any, KVSnapshot, int, int], KVSnapshot]

# Every way to get a rolled cache, by name: (handle, snapshot, drop, sinks) -> snapshot.
VARIANTS: dict[str, RollFn] = {
    "simulated_roll": simulated_roll,
    "k_ropefixed_v_rolled": k_ropefixed_v_rolled,
    "naive_slice": naive_slice,
    "reprefill": reprefill_rolled,
}


# -- selective recompute (one implementation: kvlab.ops.recompute) -------------------------------
def recompute_first(handle: ModelHandle, rolled: KVSnapshot, k: int, sinks: int = 0) -> KVSnapshot:
    """Refresh the first ``k`` slots after the sinks (the tokens that lost the most context)."""
    k = max(0, min(k, rolled.seq_len - sinks))
    return recompute_slots(handle, rolled, range(sinks, sinks + k))


def probe_deviation(handle: ModelHandle, rolled: KVSnapshot) -> torch.Tensor:
    """``[T]`` per-slot L2 distance between the rolled keys and a cheap probe's keys.

    The probe is a prefill of the rolled text through the first 2 layers only (``2 / L`` of a
    re-prefill); the deviation is measured in layer 1 (layer 0's keys depend on the token and its
    position only).
    """
    from kvlab.hf.masked import first_layers_kv

    ids = torch.tensor(rolled.token_list(), dtype=torch.long, device=handle.device)
    probe = first_layers_kv(handle, None, ids, rolled.positions, 2)[-1][0]
    return (probe.float() - rolled.keys[1].float()).norm(dim=-1).mean(dim=(0, 1)).cpu()


def recompute_most_deviant(
    handle: ModelHandle, rolled: KVSnapshot, k: int, sinks: int = 0
) -> tuple[KVSnapshot, list[int]]:
    """Refresh the ``k`` slots (after the sinks) whose probe keys deviate most; returns the slots too."""
    dev = probe_deviation(handle, rolled)
    dev[:sinks] = -1.0
    k = max(0, min(k, rolled.seq_len - sinks))
    chosen = sorted(int(i) for i in torch.topk(dev, k).indices.tolist()) if k else []
    return recompute_slots(handle, rolled, chosen), chosen
