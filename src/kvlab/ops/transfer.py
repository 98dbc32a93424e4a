"""Moving cached K/V between prompts: concatenate, re-position, replace spans, mix layers, mix K and V.

Every function takes snapshots of one model and returns a new snapshot; inputs are never written.
Invariants the functions keep:

* a slot's key is always rotated to the position the result says it has (re-positioning goes
  through :meth:`KVSnapshot.with_positions`, an exact RoPE shift);
* values carry no position, so they move between slots unchanged;
* mixing two caches slot by slot (layers, K from one and V from another) needs equal lengths, or
  an explicit ``align=(slots_a, slots_b)``: kvlab never guesses which slots correspond.

Injecting cache(A) and feeding B at the next positions is just a longer context: it equals
prefill(A + B). Real transfer questions start when A's slots are moved (``reposition``,
``drop_prefix``), computed without their original neighbours (``concat_caches``), or mixed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from kvlab.cache.snapshot import KVSnapshot, concat
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.policy.window import SinksWindow

Which = Literal["k", "v", "kv"]
SlotsLike = Sequence[int] | torch.Tensor


def layer_indices(layers: str | Iterable[int] | range, num_layers: int) -> tuple[int, ...]:
    """Sorted unique layer ids from ``range(...)``, a list, or a string like ``"0-9"``, ``"3,5,20-29"``.

    String ranges are inclusive. Raises :class:`BadInputError` for anything outside ``[0, num_layers)``.
    """
    if isinstance(layers, str):
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in layers.split(","))):
            m = re.fullmatch(r"(-?\d+)(?:\s*[-:]\s*(-?\d+))?", part)
            if not m:
                raise BadInputError(f"cannot read layer range '{part}'; use e.g. '0-9' or '3,5,20-29'")
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if hi < lo:
                raise BadInputError(f"layer range '{part}' runs backwards; write it low-high")
            ids.extend(range(lo, hi + 1))
    else:
        ids = [int(i) for i in layers]
    if not ids:
        raise BadInputError("no layers given; name at least one layer, e.g. '0-9'")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise BadInputError(
            f"layers {bad[:5]} are outside the model's {num_layers} layers (valid: 0-{num_layers - 1})"
        )
    return tuple(sorted(set(ids)))


def reposition(snap: KVSnapshot, start: int = 0) -> KVSnapshot:
    """The same slots at contiguous positions ``start .. start+T-1`` (keys re-rotated exactly)."""
    if start < 0:
        raise BadInputError(f"start position must be >= 0, got {start}")
    return snap.with_positions(torch.arange(start, start + snap.seq_len, device="cpu"))


def drop_prefix(snap: KVSnapshot, n: int, *, sinks: int = 0) -> KVSnapshot:
    """Drop slots ``sinks .. n-1``, keep the first ``sinks`` slots and slots ``n..``, re-positioned to ``0..``.

    With ``sinks=0`` the first kept token becomes position 0 without ever having been an attention
    sink; with ``sinks=4`` this is StreamingLLM's layout (4 sink tokens, then the kept window): a roll
    (:class:`~kvlab.policy.SinksWindow`) re-positioned from 0.
    """
    if not 0 <= sinks <= n < snap.seq_len:
        raise BadInputError(f"need 0 <= sinks ({sinks}) <= n ({n}) < cached tokens ({snap.seq_len})")
    return SinksWindow.dropping(snap.seq_len, n - sinks, sinks).apply(snap, start=0)


def concat_caches(first: KVSnapshot, second: KVSnapshot) -> KVSnapshot:
    """``first`` then ``second``, with ``second`` re-positioned to follow ``first`` (gaps inside it kept).

    ``second``'s K/V were computed without ``first`` in view: unlike prefill(A + B), nothing in B's
    slots knows about A. That difference is what a cache-level transfer tests.
    """
    first.require_compatible(second, "concatenating caches")
    offset = first.next_position - int(second.positions.min())
    return concat(first, second.with_positions(second.positions + offset))


def replace_span(receiver: KVSnapshot, start: int, stop: int, donor: KVSnapshot) -> KVSnapshot:
    """Slots ``start:stop`` of ``receiver`` replaced by all of ``donor``'s slots.

    The donor's slots take contiguous positions from ``receiver.positions[start]``; the receiver's
    later slots shift by ``len(donor) - (stop - start)`` so the result has no gaps or overlaps there.
    """
    receiver.require_compatible(donor, "replacing a span")
    if not 0 <= start < stop <= receiver.seq_len:
        raise BadInputError(f"span {start}:{stop} is empty or outside a cache of {receiver.seq_len} tokens")
    first_pos = int(receiver.positions[start])
    placed = reposition(donor, first_pos)
    parts = [receiver.slice(0, start)] if start > 0 else []
    parts.append(placed)
    if stop < receiver.seq_len:
        tail = receiver.slice(stop)
        delta = donor.seq_len - (stop - start)
        parts.append(tail.with_positions(tail.positions + delta) if delta else tail)
    out = parts[0]
    for p in parts[1:]:
        out = out.replace(
            keys=tuple(torch.cat((a, b), dim=2) for a, b in zip(out.keys, p.keys, strict=True)),
            values=tuple(torch.cat((a, b), dim=2) for a, b in zip(out.values, p.values, strict=True)),
            token_ids=torch.cat((out.token_ids, p.token_ids), dim=1),
            positions=torch.cat((out.positions, p.positions)),
        )
    return out


def _aligned(
    a: KVSnapshot, b: KVSnapshot, align: tuple[SlotsLike, SlotsLike] | None, what: str
) -> tuple[KVSnapshot, KVSnapshot]:
    """Both caches cut to corresponding slots; equal lengths are aligned slot by slot."""
    a.require_compatible(b, what)
    if align is None:
        if a.seq_len != b.seq_len:
            raise IncompatibleCacheError(
                f"{what}: the caches hold {a.seq_len} and {b.seq_len} tokens; pass align=(slots_a, slots_b) "
                "to say which slots correspond"
            )
        return a, b
    sa, sb = (torch.as_tensor(s, dtype=torch.long, device="cpu") for s in align)  # slot lists: host
    if sa.shape != sb.shape or sa.ndim != 1:
        raise BadInputError(
            f"{what}: align needs two equally long 1-D slot lists, got {tuple(sa.shape)} and {tuple(sb.shape)}"
        )
    return a.select(sa), b.select(sb)


def transfer_layers(
    receiver: KVSnapshot,
    donor: KVSnapshot,
    layers: str | Iterable[int] | range,
    *,
    fill: KVSnapshot | None = None,
    align: tuple[SlotsLike, SlotsLike] | None = None,
) -> KVSnapshot:
    """The donor's K/V in ``layers``; every other layer from ``fill`` if given, else the receiver's own.

    All three caches must hold the same slots (equal length, or ``align`` between receiver and donor;
    ``fill`` must then match the aligned length). Non-donor keys are re-rotated to the donor's
    positions when they differ, so every layer agrees on where each slot is. Token ids are the
    donor's (the tokens whose information is being transferred).
    """
    rec, don = _aligned(receiver, donor, align, "transferring layers")
    keep = set(layer_indices(layers, don.num_layers))
    other = rec if fill is None else fill
    if fill is not None:
        don.require_compatible(fill, "filling the other layers")
        if fill.seq_len != don.seq_len:
            raise IncompatibleCacheError(
                f"the fill cache holds {fill.seq_len} tokens but the transferred slots are {don.seq_len}; cut it to match"
            )
    if not torch.equal(other.positions.cpu(), don.positions.cpu()):
        other = other.with_positions(don.positions)
    return don.replace(
        keys=tuple(d if i in keep else o for i, (d, o) in enumerate(zip(don.keys, other.keys, strict=True))),
        values=tuple(
            d if i in keep else o for i, (d, o) in enumerate(zip(don.values, other.values, strict=True))
        ),
        provenance="transplanted",
    )


def hybrid_kv(
    k_from: KVSnapshot, v_from: KVSnapshot, *, align: tuple[SlotsLike, SlotsLike] | None = None
) -> KVSnapshot:
    """Keys (and their positions) from ``k_from``, values (and token ids) from ``v_from``, slot by slot.

    Keys say where attention goes; values say what it reads. ``align=(k_slots, v_slots)`` pairs
    slots of caches of different lengths (a roll by n pairs ``k_slots=range(n, T)`` with ``range(T-n)``).
    """
    k, v = _aligned(k_from, v_from, align, "mixing K and V")
    return k.replace(values=v.values, token_ids=v.token_ids, provenance="transplanted")


def swap_slots(
    base: KVSnapshot,
    donor: KVSnapshot,
    slots: SlotsLike = (0,),
    *,
    which: Which = "kv",
) -> KVSnapshot:
    """``base`` with the K and/or V of some slots taken from ``donor`` (default: the sink, slot 0).

    Donor keys are re-rotated from the donor slot's position to the base slot's position, so a
    swapped key differs from the base key only in content.
    """
    if which not in ("k", "v", "kv"):
        raise BadInputError(f"which must be 'k', 'v' or 'kv', got '{which}'")
    base.require_compatible(donor, "swapping slots")
    dst = torch.as_tensor(slots, dtype=torch.long, device="cpu").reshape(-1)  # slot lists: host bookkeeping
    if dst.numel() == 0:
        raise BadInputError("give at least one slot to swap")
    for name, n in (("base", base.seq_len), ("donor", donor.seq_len)):
        if int(dst.min()) < 0 or int(dst.max()) >= n:
            raise BadInputError(f"{name} slots must lie in [0, {n}), got {dst.tolist()}")
    piece = donor.select(dst)
    if "k" in which and not torch.equal(piece.positions.cpu(), base.positions[dst].cpu()):
        piece = piece.with_positions(base.positions[dst])

    def put(tensors: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        out = []
        for t, n in zip(tensors, new, strict=True):
            t = t.clone()
            t[:, :, dst.to(t.device)] = n
            out.append(t)
        return tuple(out)

    return base.replace(
        keys=put(base.keys, piece.keys) if "k" in which else base.keys,
        values=put(base.values, piece.values) if "v" in which else base.values,
    )
