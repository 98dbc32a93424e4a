"""Selective recompute: refresh chosen slots of a cache exactly, in context — kvlab's one implementation.

Used for rolled caches (:func:`kvlab.ops.suffix.recompute_first`, ``recompute_most_deviant``: the slots
that lost the most context) and for reused store chunks (:func:`kvlab.store.blend.blend`, CacheBlend's
selective recompute). One masked forward pass over the chosen tokens: each recomputed token attends
to every slot of ``before``, to the snapshot's cached (not recomputed) slots before it, and to the
recomputed tokens up to itself. In one pass that equals refreshing them one run at a time in order
(a token's K/V at layer l only depend on layer l - 1 of the tokens it sees); the slots that are not
chosen keep their cached K/V (that is the approximation being measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvlab.cache.snapshot import KVSnapshot, concat
from kvlab.errors import BadInputError
from kvlab.hf.masked import forward_masked

if TYPE_CHECKING:
    from kvlab.model.handle import ModelHandle


def recompute_slots(
    handle: ModelHandle,
    snapshot: KVSnapshot,
    slots: Sequence[int] | torch.Tensor,
    *,
    before: KVSnapshot | None = None,
) -> KVSnapshot:
    """``snapshot`` with the K/V of ``slots`` (indices into ``snapshot``) recomputed in context.

    ``before`` (optional): cached slots in front of ``snapshot`` that every recomputed token sees but
    that are not returned (a reused chunk's left context). Returns a new snapshot; inputs untouched.
    """
    # slot indices and the visibility mask are host bookkeeping (forward_masked moves the mask)
    idx = torch.as_tensor(
        list(slots) if not isinstance(slots, torch.Tensor) else slots, dtype=torch.long, device="cpu"
    )
    if idx.numel() == 0:
        return snapshot
    idx = idx.unique(sorted=True)
    if int(idx[0]) < 0 or int(idx[-1]) >= snapshot.seq_len:
        raise BadInputError(f"slots must lie in [0, {snapshot.seq_len}), got {int(idx[0])}..{int(idx[-1])}")
    if snapshot.batch_size != 1:
        raise BadInputError(f"recompute works on one sequence (batch 1), got batch {snapshot.batch_size}")
    past = snapshot if before is None else concat(before, snapshot)
    offset = 0 if before is None else before.seq_len
    r, total = int(idx.numel()), past.seq_len
    absolute = idx + offset
    visible = torch.zeros((r, total + r), dtype=torch.bool, device="cpu")
    visible[:, :total] = torch.arange(total, device="cpu")[None, :] < absolute[:, None]
    visible[:, absolute] = False  # a recomputed slot's stale K/V is never seen...
    visible[:, total:] = torch.tril(torch.ones(r, r, dtype=torch.bool, device="cpu"))  # ...its fresh one is
    keys, values, _ = forward_masked(
        handle, past, snapshot.token_ids[0, idx], snapshot.positions[idx], visible
    )

    def put(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return old.index_copy(2, idx.to(old.device), new.to(old.dtype))

    return snapshot.replace(
        keys=tuple(put(o, n) for o, n in zip(snapshot.keys, keys, strict=True)),
        values=tuple(put(o, n) for o, n in zip(snapshot.values, values, strict=True)),
    )
