"""Content addresses of cache blocks: a sha256 chain over token ids, rooted in a namespace.

A cache is cut into fixed-size token blocks. Block ``i`` is named by
``sha256(parent_hash | token ids of block i)`` where the parent of block 0 is the *namespace root*:
a sha256 of everything that decides whether cached K/V may be reused (model fingerprint, cache
dtype, RoPE spec, quantization config, block size, optional tenant salt). Two caches share a block
key only if they share the whole prefix and the namespace, so a block from another model, dtype
or RoPE config can never be found. Only stable inputs go in (no Python ``hash()``), so keys agree
across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.rope.spec import RopeSpec

KEY_VERSION = "kvlab-block-v1"
DEFAULT_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class Namespace:
    """What must match for two caches to be interchangeable; ``root`` is block 0's parent hash."""

    fingerprint: str
    dtype: str
    rope: RopeSpec | None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    quantization: str | None = None
    salt: str | None = None
    model_name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise BadInputError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
        if not self.fingerprint:
            raise BadInputError("a store namespace needs the model fingerprint")

    @classmethod
    def for_model(
        cls,
        handle: Any,
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
        )

    @classmethod
    def for_snapshot(
        cls,
        snapshot: Any,
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
        }

    def info(self) -> dict:
        """The hashed fields plus the model name: enough to rebuild a snapshot from stored blocks."""
        return self.to_json() | {"model_name": self.model_name}

    @classmethod
    def from_info(cls, data: dict) -> Namespace:
        return cls(
            fingerprint=data["fingerprint"],
            dtype=data["dtype"],
            rope=RopeSpec.from_json(data["rope"]) if data.get("rope") else None,
            block_tokens=int(data["block_tokens"]),
            quantization=data.get("quantization"),
            salt=data.get("salt"),
            model_name=data.get("model_name", ""),
        )

    @property
    def root(self) -> str:
        payload = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()


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
