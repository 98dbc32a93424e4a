"""The KV snapshot: kvlab's immutable picture of a model's cache.

A :class:`KVSnapshot` holds, for every layer, the cached keys (post-RoPE, as the model stores them)
and values, plus what is needed to use or compare them later: the token ids, the RoPE position of
every cached token, the RoPE spec, and the fingerprint of the model that made it. Operations return
new snapshots and never write into the tensors of an existing one; treat the tensors as read-only.

Positions are explicit because after a roll, an eviction or a transplant they are no longer
``0..T-1``; a query's position is ``next_position`` unless a caller says otherwise.

A snapshot may carry a validity mask (``valid``, one ``[batch, kv_heads, T]`` bool tensor per layer): a
slot whose entry is False is not part of that head's cache. This is how an evicted cache (each layer and
KV head keeping its own slots, kvpress-style masking) or a ragged per-head budget is held as a snapshot
that :meth:`~kvlab.model.ModelHandle.forward` runs: masked slots are hidden from attention, and keys stay
at their original positions. Operations that do not understand a mask refuse a masked snapshot
(:meth:`KVSnapshot.require_unmasked`) instead of reading its hidden slots.

Every snapshot also says how it was made (:data:`PROVENANCES`). Only a ``"prefill"`` is the exact
cache a model computes for its tokens at positions ``0..T-1``; anything that serves a cache *as* that
(the store's exact namespace, reuse) checks it. Operations that change tensors, ids or positions
lose ``"prefill"`` unless they provably keep it (a prefix of a prefill is a prefill).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import BadInputError, IncompatibleCacheError, UnsupportedModelError
from kvlab.rope.ops import shift_keys
from kvlab.rope.spec import Rope, RopeSpec

#: How a snapshot was made. "prefill": the model's own cache of ``token_ids`` at positions 0..T-1;
#: "computed": computed by the model on top of a non-prefill past or at other positions; "rolled",
#: "repositioned", "quantized", "transplanted", "edited": made by an operation; "unknown": not said.
PROVENANCES = (
    "prefill",
    "computed",
    "rolled",
    "repositioned",
    "quantized",
    "transplanted",
    "edited",
    "unknown",
)
#: ``token_ids`` of a slot whose KV heads hold different tokens (a re-packed eviction:
#: :func:`kvlab.policy.evict.repack`); never a vocabulary id.
MIXED_TOKEN = -1
_TENSOR_FIELDS = frozenset({"keys", "values", "token_ids", "positions", "valid"})


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """Per-layer K/V of one cached sequence.

    Attributes:
        keys: one tensor per layer, ``[batch, kv_heads, T, head_dim]``, post-RoPE.
        values: ``[batch, kv_heads, T, value_head_dim]``, one shape for all layers; ``value_head_dim`` is
            ``head_dim`` for every model kvlab loads (the file format and the checks keep them apart).
        token_ids: ``[batch, T]`` int64, the token cached at each slot (:data:`MIXED_TOKEN` where the
            KV heads hold different tokens at one slot).
        positions: ``[T]`` int64, the RoPE position each slot's key was rotated to.
        (K/V live on the model's device; ids and positions are metadata kvlab reads on the host, so
        kvlab's snapshots keep them on the CPU and move them where they rotate or feed a model.)
        rope: the model's RoPE (one spec, or one per layer for hybrid models), or None without RoPE.
        fingerprint: the model fingerprint (architecture + config + weights hash).
        model_name: a human-readable model name, for reports only.
        provenance: how the snapshot was made, one of :data:`PROVENANCES`.
        valid: None (every slot is cached), or per layer ``[batch, kv_heads, T]`` bool on the keys'
            device: which slots each layer's KV heads hold (False: evicted, hidden from attention).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    rope: Rope | None
    fingerprint: str
    model_name: str = ""
    provenance: str = "unknown"
    valid: tuple[torch.Tensor, ...] | None = None

    def __post_init__(self) -> None:
        if self.provenance not in PROVENANCES:
            raise BadInputError(
                f"provenance must be one of {', '.join(PROVENANCES)}, got {self.provenance!r}"
            )
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "values", tuple(self.values))
        if len(self.keys) == 0 or len(self.keys) != len(self.values):
            raise BadInputError(
                f"a snapshot needs matching K and V layers, got {len(self.keys)} and {len(self.values)}"
            )
        shape = tuple(self.keys[0].shape)
        if len(shape) != 4:
            raise BadInputError(f"cached keys must be [batch, kv_heads, seq, head_dim], got shape {shape}")
        v_shape = tuple(self.values[0].shape)
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if tuple(k.shape) != shape or tuple(v.shape) != v_shape or v_shape[:3] != shape[:3]:
                raise IncompatibleCacheError(
                    f"layer {i} has K {tuple(k.shape)} / V {tuple(v.shape)}, layer 0 has K {shape} / V {v_shape}; "
                    "kvlab snapshots need one geometry for all layers"
                )
        per_layer = getattr(self.rope, "layers", None)
        if per_layer is not None and len(per_layer) != len(self.keys):
            raise IncompatibleCacheError(
                f"the per-layer RoPE covers {len(per_layer)} layers, the cache has {len(self.keys)}"
            )
        if tuple(self.token_ids.shape) != (shape[0], shape[2]):
            raise BadInputError(
                f"token_ids {tuple(self.token_ids.shape)} do not match the cache [{shape[0]}, {shape[2]}]"
            )
        if tuple(self.positions.shape) != (shape[2],):
            raise BadInputError(
                f"positions {tuple(self.positions.shape)} do not match {shape[2]} cached tokens"
            )
        if self.valid is not None:
            object.__setattr__(self, "valid", tuple(self.valid))
            if len(self.valid) != len(self.keys) or any(
                m.dtype != torch.bool or tuple(m.shape) != shape[:3] or m.device != k.device
                for m, k in zip(self.valid, self.keys, strict=False)
            ):
                raise BadInputError(
                    f"a validity mask needs one bool [batch, kv_heads, T] = {list(shape[:3])} tensor per layer, "
                    "on the keys' device"
                )

    # -- geometry -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def seq_len(self) -> int:
        return self.keys[0].shape[2]

    def __len__(self) -> int:
        return self.seq_len

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]

    @property
    def value_head_dim(self) -> int:
        """The head size of the cached values (``head_dim`` for every model kvlab loads)."""
        return self.values[0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors (not counting ids and positions)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def is_masked(self) -> bool:
        """True when some layers' heads hide slots (:attr:`valid`)."""
        return self.valid is not None

    @property
    def held_slots(self) -> int:
        """Slots held, summed over layers, batch rows and KV heads (every slot when unmasked)."""
        if self.valid is None:
            return self.num_layers * self.batch_size * self.num_kv_heads * self.seq_len
        return int(sum(int(m.sum()) for m in self.valid))

    @property
    def held_nbytes(self) -> int:
        """K/V bytes a compacted cache of the valid slots would hold (:attr:`nbytes` when unmasked):
        what an implementation that frees evicted slots keeps, not what this masked tensor occupies."""
        if self.valid is None:
            return self.nbytes
        per_slot = (
            self.head_dim * self.keys[0].element_size() + self.value_head_dim * self.values[0].element_size()
        )
        return self.held_slots * per_slot

    def valid_layers(self) -> tuple[torch.Tensor, ...]:
        """Per layer ``[batch, kv_heads, T]`` validity, all True when unmasked (new tensors then)."""
        if self.valid is not None:
            return self.valid
        b, h, t = self.keys[0].shape[:3]
        return tuple(torch.ones(b, h, t, dtype=torch.bool, device=k.device) for k in self.keys)

    def require_unmasked(self, what: str) -> None:
        """Raise for a masked snapshot: ``what`` would read the hidden slots as if they were cached."""
        if self.valid is not None:
            raise IncompatibleCacheError(
                f"{what} reads every slot, but this cache hides some per head (an evicted, masked cache); "
                "run it with ModelHandle.forward, or compare unmasked caches"
            )

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // max(self.seq_len * self.batch_size, 1)

    @property
    def next_position(self) -> int:
        """The RoPE position the next token would get: one past the largest cached position."""
        return int(self.positions.max().item()) + 1 if self.seq_len else 0

    def token_list(self, row: int = 0) -> list[int]:
        return [int(t) for t in self.token_ids[row].tolist()]

    # -- pure operations -----------------------------------------------------------------------
    @property
    def is_prefill(self) -> bool:
        """True when this is the model's own cache of its tokens at positions 0..T-1 (see PROVENANCES)."""
        return self.provenance == "prefill"

    def replace(self, **changes) -> KVSnapshot:
        """A new snapshot with some fields replaced (tensors are shared, never written).

        Replacing keys, values, ids or positions without saying the new ``provenance`` marks the
        result ``"edited"``: nothing built by hand can pass for a prefill.
        """
        if "provenance" not in changes and _TENSOR_FIELDS & changes.keys():
            changes["provenance"] = "edited"
        return dataclasses.replace(self, **changes)

    def _is_leading(self, idx: torch.Tensor) -> bool:
        return bool(torch.equal(idx.cpu(), torch.arange(idx.numel(), device="cpu")))

    def select(self, indices: Sequence[int] | torch.Tensor) -> KVSnapshot:
        """Keep only the given slots (in the given order); positions are kept, keys are not re-rotated."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        if idx.ndim != 1 or idx.numel() == 0:
            raise BadInputError("select needs a non-empty 1-D list of slot indices")
        if int(idx.min()) < 0 or int(idx.max()) >= self.seq_len:
            raise BadInputError(
                f"slot indices must lie in [0, {self.seq_len}), got {int(idx.min())}..{int(idx.max())}"
            )
        return self.replace(
            keys=tuple(k.index_select(2, idx) for k in self.keys),
            values=tuple(v.index_select(2, idx) for v in self.values),
            token_ids=self.token_ids.index_select(1, idx.to(self.token_ids.device)),
            positions=self.positions.index_select(0, idx.to(self.positions.device)),
            valid=None if self.valid is None else tuple(m.index_select(2, idx) for m in self.valid),
            provenance=self.provenance if self.is_prefill and self._is_leading(idx) else "edited",
        )

    def slice(self, start: int = 0, stop: int | None = None) -> KVSnapshot:
        """Slots ``start:stop`` (views, positions kept)."""
        stop = self.seq_len if stop is None else stop
        if not 0 <= start < stop <= self.seq_len:
            raise BadInputError(f"slice {start}:{stop} is empty or outside a cache of {self.seq_len} tokens")
        return self.replace(
            keys=tuple(k[:, :, start:stop] for k in self.keys),
            values=tuple(v[:, :, start:stop] for v in self.values),
            token_ids=self.token_ids[:, start:stop],
            positions=self.positions[start:stop],
            valid=None if self.valid is None else tuple(m[:, :, start:stop] for m in self.valid),
            provenance=self.provenance if self.is_prefill and start == 0 else "edited",
        )

    def with_positions(self, new_positions: Sequence[int] | torch.Tensor) -> KVSnapshot:
        """Re-rotate every key from its current position to ``new_positions`` (exact RoPE shift)."""
        new = torch.as_tensor(new_positions, dtype=torch.long, device="cpu")
        if tuple(new.shape) != (self.seq_len,):
            raise BadInputError(f"need {self.seq_len} new positions, got shape {tuple(new.shape)}")
        rope = self.require_rope("re-positioning keys")
        delta = (new - self.positions.cpu()).to(self.device)
        if bool((delta == 0).all()):
            return self.replace(positions=new, provenance=self.provenance)
        return self.replace(
            keys=tuple(_shift_layer(k, delta, rope.for_layer(i)) for i, k in enumerate(self.keys)),
            positions=new,
            provenance="repositioned",
        )

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> KVSnapshot:
        """Move and/or cast; a cast to another dtype is no longer the model's own cache ("edited")."""
        cast = dtype is not None and dtype != self.dtype
        return self.replace(
            keys=tuple(k.to(device=device, dtype=dtype) for k in self.keys),
            values=tuple(v.to(device=device, dtype=dtype) for v in self.values),
            valid=None if self.valid is None else tuple(m.to(device=device) for m in self.valid),
            provenance="edited" if cast else self.provenance,
        )

    def clone(self) -> KVSnapshot:
        """A deep copy whose tensors share no storage with this snapshot."""
        return self.replace(
            keys=tuple(k.clone() for k in self.keys),
            values=tuple(v.clone() for v in self.values),
            token_ids=self.token_ids.clone(),
            positions=self.positions.clone(),
            valid=None if self.valid is None else tuple(m.clone() for m in self.valid),
            provenance=self.provenance,
        )

    def require_prefill(self, what: str) -> None:
        """Raise unless this is an exact prefill (operations whose result is only exact from one)."""
        if not self.is_prefill:
            raise IncompatibleCacheError(
                f"{what} needs an exact prefill of the cached tokens, but this cache is {self.provenance}; "
                "prefill the tokens with the model first"
            )

    def require_rope(self, what: str) -> Rope:
        if self.rope is None:
            raise UnsupportedModelError(f"{what} needs a model with rotary position embeddings (RoPE)")
        return self.rope

    def require_compatible(self, other: KVSnapshot, what: str = "combining these caches") -> None:
        """Raise unless ``other`` comes from the same model with the same geometry and dtype."""
        if other.fingerprint != self.fingerprint:
            raise IncompatibleCacheError(
                f"{what}: the caches come from different models ({self.fingerprint[:12]} vs {other.fingerprint[:12]})"
            )
        mine = (self.num_layers, self.num_kv_heads, self.head_dim, self.value_head_dim, self.dtype)
        theirs = (other.num_layers, other.num_kv_heads, other.head_dim, other.value_head_dim, other.dtype)
        if mine != theirs:
            raise IncompatibleCacheError(f"{what}: cache geometry {mine} differs from {theirs}")

    def describe(self) -> str:
        return (
            f"KVSnapshot({self.model_name or self.fingerprint[:12]}: {self.num_layers} layers x "
            f"[{self.batch_size}, {self.num_kv_heads}, {self.seq_len}, {self.head_dim}] {str(self.dtype).replace('torch.', '')}, "
            f"positions {int(self.positions.min()) if self.seq_len else 0}..{self.next_position - 1}, {self.provenance}"
            + (
                f", masked: {self.held_slots / max(self.num_layers * self.batch_size * self.num_kv_heads * self.seq_len, 1):.0%} held)"
                if self.valid is not None
                else ")"
            )
        )

    __repr__ = describe


def concat(first: KVSnapshot, second: KVSnapshot) -> KVSnapshot:
    """Slots of ``first`` then ``second``, positions and keys kept as they are (no re-rotation)."""
    first.require_compatible(second, "concatenating caches")
    return first.replace(
        keys=tuple(torch.cat((a, b), dim=2) for a, b in zip(first.keys, second.keys, strict=True)),
        values=tuple(torch.cat((a, b), dim=2) for a, b in zip(first.values, second.values, strict=True)),
        token_ids=torch.cat((first.token_ids, second.token_ids), dim=1),
        positions=torch.cat((first.positions, second.positions)),
        valid=None
        if first.valid is None and second.valid is None
        else tuple(
            torch.cat((a, b), dim=2) for a, b in zip(first.valid_layers(), second.valid_layers(), strict=True)
        ),
    )


def require_stackable(snapshots: Sequence[KVSnapshot]) -> None:
    """Refuse caches that cannot be the rows of one batch: another model, or other lengths or positions."""
    if not snapshots:
        raise BadInputError("stacking caches into a batch needs at least one cache")
    first = snapshots[0]
    for s in snapshots[1:]:
        first.require_compatible(s, "stacking caches into a batch")
        if s.seq_len != first.seq_len or not torch.equal(s.positions, first.positions):
            raise BadInputError(
                "stacking caches into a batch needs equal lengths and equal slot positions; "
                f"got {first.describe()} and {s.describe()}"
            )


def stack_rows(snapshots: Sequence[KVSnapshot]) -> KVSnapshot:
    """Caches of equal length and equal positions as the rows of one batch (new tensors).

    Feeding many caches the same tokens in one batched forward streams the weights once instead of
    once per cache, which is what decoding costs on a CPU. Rows must come from the same model and
    share their slot positions (a batch has one position per slot).
    """
    require_stackable(snapshots)
    first = snapshots[0]
    return first.replace(
        keys=tuple(torch.cat(layer, dim=0) for layer in zip(*(s.keys for s in snapshots), strict=True)),
        values=tuple(torch.cat(layer, dim=0) for layer in zip(*(s.values for s in snapshots), strict=True)),
        token_ids=torch.cat([s.token_ids for s in snapshots], dim=0),
        valid=None
        if all(s.valid is None for s in snapshots)
        else tuple(
            torch.cat(layer, dim=0) for layer in zip(*(s.valid_layers() for s in snapshots), strict=True)
        ),
        provenance=first.provenance if all(s.provenance == first.provenance for s in snapshots) else "edited",
    )


def batchable_groups(named: dict[str, KVSnapshot]) -> list[list[str]]:
    """Names of the caches that :func:`stack_rows` can batch together (equal length and positions), in order."""
    groups: dict[tuple, list[str]] = {}
    for name, snap in named.items():
        groups.setdefault((snap.seq_len, tuple(snap.positions.tolist())), []).append(name)
    return list(groups.values())


def _shift_layer(keys: torch.Tensor, delta: torch.Tensor, spec: RopeSpec | None) -> torch.Tensor:
    """One layer's keys moved by ``delta``; a layer without RoPE (NoPE) carries no position: unchanged."""
    return keys if spec is None else shift_keys(keys, delta, spec)
