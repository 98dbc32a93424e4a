"""Content addresses of cache blocks: a sha256 chain over token ids, rooted in a namespace.

A cache is cut into fixed-size token blocks. Block ``i`` is named by
``sha256(parent_hash | token ids of block i)`` where the parent of block 0 is the *namespace root*:
a sha256 of everything that decides whether cached K/V may be reused (model fingerprint, cache
geometry (layers, KV heads, head dim), dtype, RoPE spec, quantization config, block size, optional tenant salt). Two caches share a block
key only if they share the whole prefix and the namespace, so a block from another model, dtype
or RoPE config can never be found. Only stable inputs go in (no Python ``hash()``), so keys agree
across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.rope.spec import Rope, rope_from_json

if TYPE_CHECKING:
    from kvlab.cache.snapshot import KVSnapshot
    from kvlab.model.handle import ModelHandle

# v2: the namespace hashes the cache geometry, so a snapshot of another shape can never share a root.
KEY_VERSION = "kvlab-block-v2"
DEFAULT_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Namespace:
    """What must match for two caches to be interchangeable; ``root`` is block 0's parent hash."""

    fingerprint: str
    dtype: str
    rope: Rope | None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    quantization: str | None = None
    salt: str | None = None
    model_name: str = ""
    #: (layers, KV heads, head dim) of every cached K and V (V's head size is K's, as in every model
    #: kvlab loads); None only for namespaces built by hand.
    geometry: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.geometry is not None and (
            len(self.geometry) != 3 or not all(isinstance(g, int) and g >= 1 for g in self.geometry)
        ):
            raise BadInputError(f"namespace geometry must be three positive integers, got {self.geometry!r}")
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise BadInputError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if not self.fingerprint:
            raise BadInputError("a store namespace needs the model fingerprint")

    @classmethod
    def for_model(
        cls,
        handle: ModelHandle,
        *,
        dtype: str | torch.dtype | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        quantization: str | None = None,
        salt: str | None = None,
    ) -> Namespace:
        """The namespace of caches ``handle`` produces (dtype defaults to the model's)."""
        return cls(
            fingerprint=handle.fingerprint,
            dtype=_dtype_name(dtype or handle.dtype),
            rope=handle.rope,
            block_tokens=block_tokens,
            quantization=quantization,
            salt=salt,
            model_name=handle.name,
            geometry=(handle.facts.num_layers, handle.facts.num_kv_heads, handle.facts.head_dim),
        )

    @classmethod
    def for_snapshot(
        cls,
        snapshot: KVSnapshot,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        quantization: str | None = None,
        salt: str | None = None,
    ) -> Namespace:
        return cls(
            fingerprint=snapshot.fingerprint,
            dtype=_dtype_name(snapshot.dtype),
            rope=snapshot.rope,
            block_tokens=block_tokens,
            quantization=quantization,
            salt=salt,
            model_name=snapshot.model_name,
            geometry=snapshot_geometry(snapshot),
        )

    def to_json(self) -> dict:
        """The hashed fields (``model_name`` is a label and is left out)."""
        return {
            "version": KEY_VERSION,
            "fingerprint": self.fingerprint,
            "dtype": self.dtype,
            "rope": self.rope.to_json() if self.rope is not None else None,
            "block_tokens": self.block_tokens,
            "quantization": self.quantization,
            "salt": self.salt,
            "geometry": list(self.geometry) if self.geometry is not None else None,
        }

    def info(self) -> dict:
        """The hashed fields plus the model name: enough to rebuild a snapshot from stored blocks."""
        return self.to_json() | {"model_name": self.model_name}

    @classmethod
    def from_info(cls, data: dict) -> Namespace:
        return cls(
            fingerprint=data["fingerprint"],
            dtype=data["dtype"],
            rope=rope_from_json(data["rope"]) if data.get("rope") else None,
            block_tokens=int(data["block_tokens"]),
            quantization=data.get("quantization"),
            salt=data.get("salt"),
            model_name=data.get("model_name", ""),
            # any length read from the file: __post_init__ refuses one that is not three positive ints
            geometry=cast(
                "tuple[int, int, int] | None",
                tuple(int(g) for g in data["geometry"]) if data.get("geometry") else None,
            ),
        )

    @property
    def root(self) -> str:
        payload = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()


def block_problem(block: Any) -> str | None:
    """Why a decoded block cannot be what its name says, or None: its hash must be the hash of its parent
    and tokens, its namespace record must hash to its namespace, and its K/V must have that namespace's
    geometry and dtype. A checksum proves the bytes are intact; this proves they belong where filed."""
    if block_hash(block.parent, block.token_ids) != block.hash:
        return "its token ids do not hash to its name"
    if block.start < 0 or (block.start == 0) != (block.parent == block.namespace):
        return "its start position does not fit its place in the chain"
    info = block.namespace_info
    if info is None:
        return None
    try:
        ns = Namespace.from_info(info)
    except Exception as exc:  # any malformed record is a finding, never a crash
        return f"its namespace record is unreadable ({type(exc).__name__})"
    if ns.root != block.namespace:
        return "its namespace record does not hash to its namespace"
    k, v = block.keys, block.values
    if ns.geometry is not None and (
        (k.shape[0], k.shape[1], k.shape[3]) != ns.geometry
        or (v.shape[0], v.shape[1], v.shape[3]) != ns.geometry
    ):
        return (
            f"its K {tuple(k.shape)} / V {tuple(v.shape)} do not have its namespace's geometry "
            f"{ns.geometry} (layers, KV heads, head size)"
        )
    if _dtype_name(k.dtype) != ns.dtype or _dtype_name(v.dtype) != ns.dtype:
        return f"its dtype {_dtype_name(k.dtype)} is not its namespace's {ns.dtype}"
    return None


def snapshot_geometry(snapshot: KVSnapshot) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a snapshot's cache (of its keys; see :func:`geometry_problem`)."""
    k = snapshot.keys[0]
    return (len(snapshot.keys), int(k.shape[1]), int(k.shape[3]))


def geometry_problem(snapshot: KVSnapshot, geometry: tuple[int, int, int] | None, dtype: str) -> str | None:
    """Why ``snapshot``'s K and V cannot be blocks of a namespace of ``geometry`` and ``dtype``, or None.

    Every layer's K and V must be ``[batch, heads, T, head]`` with the namespace's layers, KV heads and
    head size (V's head size included: a cache whose values are narrower than its keys would pass a
    check of the keys alone and fail inside the model), and both must have its dtype.
    """
    keys, values = snapshot.keys, snapshot.values
    k0, v0 = keys[0], values[0]
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if (
            k.dim() != 4
            or v.dim() != 4
            or tuple(k.shape) != tuple(k0.shape)
            or tuple(v.shape) != tuple(v0.shape)
        ):
            return f"layer {i} has K {tuple(k.shape)} / V {tuple(v.shape)}, unlike layer 0"
        if _dtype_name(k.dtype) != dtype or _dtype_name(v.dtype) != dtype:
            return f"layer {i} has K {_dtype_name(k.dtype)} / V {_dtype_name(v.dtype)}, not {dtype}"
    if tuple(v0.shape[:3]) != tuple(k0.shape[:3]):
        return f"V {tuple(v0.shape)} does not match K {tuple(k0.shape)}"
    if geometry is not None:
        got = (len(keys), int(k0.shape[1]), int(k0.shape[3]))
        if got != geometry:
            return f"geometry {got} (layers, KV heads, K head size) is not {geometry}"
        if int(v0.shape[3]) != geometry[2]:
            return f"V head size {int(v0.shape[3])} is not the K head size {geometry[2]}"
    return None


def _dtype_name(dtype: str | torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def block_hash(parent: str, token_ids: Sequence[int]) -> str:
    """sha256 of the parent hash and the block's token ids (int64 little-endian)."""
    h = hashlib.sha256()
    h.update(KEY_VERSION.encode())
    h.update(parent.encode())
    h.update(np.asarray(list(token_ids), dtype="<i8").tobytes())
    return h.hexdigest()


def chain_hashes(token_ids: Sequence[int], namespace: Namespace) -> list[str]:
    """Hashes of every *full* block of ``token_ids``, each chained on the one before."""
    ids = [int(t) for t in token_ids]
    n = namespace.block_tokens
    out: list[str] = []
    parent = namespace.root
    for start in range(0, len(ids) - n + 1, n):
        parent = block_hash(parent, ids[start : start + n])
        out.append(parent)
    return out
