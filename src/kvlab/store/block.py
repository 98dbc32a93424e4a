"""One stored block: the K/V of up to ``block_tokens`` consecutive tokens, and its byte format.

A block's bytes are a valid safetensors file holding ``k`` and ``v``, each
``[layers, kv_heads, n, head_dim]``; the header's ``kvlab_block`` entry is JSON with the block's
hash, parent, namespace root, token ids, start position and a checksum over that JSON and the tensor
bytes. :func:`decode_block` verifies the checksum and that the block is the one asked for, so a torn,
flipped or misplaced block is never used. Decoded tensors are read-only views of the buffer they
came from (an ``mmap`` or a ``bytes`` object, kept alive by the tensors).

Checksums name their algorithm: version 2 blocks (written now) carry ``xxh3-64:<16 hex>``; version 1
blocks (kvlab before the switch) carry ``crc32:<8 hex>`` and are still read and verified. A block
of an unknown version or checksum algorithm (say, written by a newer kvlab) raises
:class:`~kvlab.store.errors.UnsupportedBlockError`, which tiers treat like any corrupt block: a miss.
The block's *address* is unaffected: it stays the sha256 chain of :mod:`kvlab.store.keys`.
"""

from __future__ import annotations

import json
import math
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from safetensors.torch import save

from kvlab.cache.io import loads_bounded
from kvlab.store.errors import CorruptBlockError, UnsupportedBlockError

BLOCK_FORMAT = "kvlab.block"
CHECKSUM = "xxh3-64"  # the algorithm written
_VERSION_OF = {"xxh3-64": 2, "crc32": 1}  # checksum algorithm -> block version that carries it
READ_VERSIONS = (1, 2)

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
#: A block's safetensors header is its token ids, its namespace record and two tensor entries: tens of
#: KiB for thousands of tokens. A header longer than this, or nested deeper than the JSON bound of
#: :func:`kvlab.cache.io.loads_bounded`, is not a block's (refused before it is parsed).
MAX_HEADER_BYTES = 16 * 2**20


@dataclass(frozen=True, eq=False)
class BlockPlace:
    """Which block it is and where it sits in its chain (what a :class:`Block` and its header share).

    Attributes:
        hash / parent: this block's chained hash and its parent's (the namespace root for block 0).
        namespace: the namespace root; token_ids: its ``n`` tokens, at positions ``start..``.
    """

    hash: str
    parent: str
    namespace: str
    start: int
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, eq=False)
class Block(BlockPlace):
    """K/V of tokens ``start .. start + len(token_ids) - 1`` of a cached prefix.

    Attributes:
        keys / values: ``[layers, kv_heads, n, head_dim]`` (keys post-RoPE at positions ``start..``).
        token_ids: the ``n`` token ids (``n`` < block size only for a partial, last block).
        namespace_info: the namespace's fields (fingerprint, dtype, RoPE, model name), so a prefix can be
            rebuilt as a snapshot from the store alone.
    """

    keys: torch.Tensor
    values: torch.Tensor
    namespace_info: dict | None = None

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


# -- checksums -------------------------------------------------------------------------------------
class _Crc32:
    """CRC-32 with the hashlib-like interface of xxhash's objects (for version 1 blocks)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_HASHERS = {"xxh3-64": xxhash.xxh3_64, "crc32": _Crc32}


def new_checksum(algorithm: str, meta_bytes: bytes) -> Any:
    """A running checksum of ``algorithm`` already fed the canonical metadata; feed it the tensor bytes."""
    h = _HASHERS[algorithm]()
    h.update(meta_bytes)
    return h


def checksum_string(algorithm: str, meta_bytes: bytes, chunks: Iterable[Any]) -> str:
    """``"<algorithm>:<hex>"`` over the canonical metadata and then ``chunks`` (the tensor bytes, in file order).

    Feeding the bytes in pieces gives the same result as feeding them at once, so a reader can check
    a block that it read straight into scattered destinations.

    XXH3-64 (the default) runs at memory speed (tens of GB/s, ~8x CRC-32 here) and, like CRC-32,
    guards against accidental damage (bit rot, truncation, a stray write); a random corruption
    passes unnoticed with probability 2^-64. It is not a defence against a malicious writer; no
    unkeyed checksum is, since the writer can recompute it. Block addresses stay sha256.
    """
    h = new_checksum(algorithm, meta_bytes)
    for c in chunks:
        h.update(c)
    return f"{algorithm}:{h.hexdigest()}"


def split_checksum(claimed: Any) -> tuple[str, str]:
    """``(algorithm, hex)`` of a stored checksum; UnsupportedBlockError for a missing or unknown one."""
    if not isinstance(claimed, str) or ":" not in claimed:
        raise UnsupportedBlockError(f"block has no usable checksum ({claimed!r})")
    algorithm, _, value = claimed.partition(":")
    if algorithm not in _HASHERS:
        raise UnsupportedBlockError(
            f"block was stored with an unknown checksum format {algorithm!r} "
            f"(this kvlab reads {', '.join(sorted(_HASHERS))}); written by a newer kvlab?"
        )
    return algorithm, value


def canonical_meta(meta: dict) -> bytes:
    """The bytes of the metadata the checksum covers (every field but the checksum, sorted keys)."""
    return json.dumps(
        {k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True, separators=(",", ":")
    ).encode()


def _meta(block: Block, version: int) -> dict:
    return {
        "format": BLOCK_FORMAT,
        "version": version,
        "hash": block.hash,
        "parent": block.parent,
        "namespace": block.namespace,
        "start": block.start,
        "token_ids": list(block.token_ids),
        "ns": block.namespace_info,
    }


def encode_block(block: Block, *, checksum: str = CHECKSUM) -> bytes:
    """The block as safetensors bytes with a self-checking header.

    ``checksum="crc32"`` writes a version 1 block, as kvlab did before XXH3 (for compatibility tests).
    """
    if checksum not in _VERSION_OF:
        raise ValueError(f"unknown checksum {checksum!r}; use one of {sorted(_VERSION_OF)}")
    tensors = {"k": block.keys.detach().cpu().contiguous(), "v": block.values.detach().cpu().contiguous()}
    meta = _meta(block, _VERSION_OF[checksum])
    raw = save(tensors, metadata={"kvlab_block": json.dumps(meta)})
    n = int.from_bytes(raw[:8], "little")
    meta["checksum"] = checksum_string(checksum, canonical_meta(meta), [memoryview(raw)[8 + n :]])
    return save(tensors, metadata={"kvlab_block": json.dumps(meta)})


# -- reading ---------------------------------------------------------------------------------------
def read_meta(buffer: bytes | memoryview, key: str, what: str) -> tuple[dict, dict, int]:
    """``(the JSON object at metadata entry key, safetensors header, data offset)`` of safetensors bytes;
    CorruptBlockError ("unreadable <what>") when they have none.

    Only the header is needed: ``buffer`` may stop where the tensor bytes begin.
    """
    view = memoryview(buffer)
    try:
        n = int.from_bytes(view[:8], "little")
        if len(view) < 8 or n <= 0 or n > MAX_HEADER_BYTES or 8 + n > len(view):
            raise ValueError("bad header length")
        header = loads_bounded(bytes(view[8 : 8 + n]), max_bytes=MAX_HEADER_BYTES)
        meta = loads_bounded(header["__metadata__"][key], max_bytes=MAX_HEADER_BYTES)
        if not isinstance(meta, dict):
            raise TypeError("metadata is not an object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptBlockError(f"unreadable {what} ({exc})") from None
    return meta, header, 8 + n


def read_block_meta(buffer: bytes | memoryview) -> tuple[dict, dict, int]:
    """``(kvlab meta, safetensors header, data offset)`` of a block buffer; raises CorruptBlockError."""
    meta, header, offset = read_meta(buffer, "kvlab_block", "block header")
    if meta.get("format") != BLOCK_FORMAT:
        raise CorruptBlockError(f"not a kvlab block (format {meta.get('format')!r})")
    if meta.get("version") not in READ_VERSIONS:
        raise UnsupportedBlockError(
            f"block format version {meta.get('version')!r} is not one this kvlab reads {READ_VERSIONS}; "
            "written by a newer kvlab?"
        )
    return meta, header, offset


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data area (after the header)
    end: int


@dataclass(frozen=True)
class BlockHeader(BlockPlace):
    """A block's parsed and checked header: everything but the tensor bytes (and their checksum check)."""

    namespace_info: dict | None
    k: TensorSpec
    v: TensorSpec
    data_offset: int  # where the tensor bytes begin in the file
    data_bytes: int  # how many tensor bytes follow the header
    algorithm: str
    checksum: str  # hex digest the tensor bytes (after ``meta_bytes``) must give
    meta_bytes: bytes

    def hasher(self) -> Any:
        """A running checksum of the block's algorithm, already fed its metadata: feed it the data area."""
        return new_checksum(self.algorithm, self.meta_bytes)

    def check(self, hasher: Any) -> None:
        """Raise CorruptBlockError unless ``hasher`` (:meth:`hasher` fed the whole data area, in file order)
        gives the checksum."""
        if hasher.hexdigest() != self.checksum:
            raise CorruptBlockError(f"block {self.hash[:12]} failed its {self.algorithm} checksum")

    def block(self, keys: torch.Tensor, values: torch.Tensor) -> Block:
        """The block this header describes, holding ``keys`` and ``values``."""
        return Block(
            self.hash,
            self.parent,
            self.namespace,
            self.start,
            self.token_ids,
            keys,
            values,
            self.namespace_info,
        )


def parse_block_header(buffer: bytes | memoryview, total_size: int) -> BlockHeader:
    """Parse and check the header of a block file of ``total_size`` bytes (``buffer`` holds at least its header)."""
    meta, header, offset = read_block_meta(buffer)
    algorithm, checksum = split_checksum(meta.get("checksum"))
    short = str(meta.get("hash"))[:12]
    data_bytes = total_size - offset
    try:
        specs = {}
        for name in ("k", "v"):
            info = header[name]
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(map(int, info["shape"]))
            begin, end = map(int, info["data_offsets"])
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_bytes:
                raise ValueError(f"{name} lies outside the file")
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{name} has {end - begin} bytes for shape {shape}")
            specs[name] = TensorSpec(dtype, shape, begin, end)
        k, v = specs["k"], specs["v"]
        (a0, a1), (b0, b1) = sorted([(k.begin, k.end), (v.begin, v.end)])
        if (a0, a1, b1) != (0, b0, data_bytes):  # the declared size is the file's: no gap, no tail
            raise ValueError(f"its tensors declare {a1 - a0 + b1 - b0} bytes, the block holds {data_bytes}")
        ids = tuple(map(int, meta["token_ids"]))
        hdr = BlockHeader(
            hash=str(meta["hash"]),
            parent=str(meta["parent"]),
            namespace=str(meta["namespace"]),
            start=int(meta["start"]),
            token_ids=ids,
            namespace_info=meta.get("ns"),
            k=k,
            v=v,
            data_offset=offset,
            data_bytes=data_bytes,
            algorithm=algorithm,
            checksum=checksum,
            meta_bytes=canonical_meta(meta),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptBlockError(f"block {short} has malformed tensors ({exc})") from None
    if (
        len(k.shape) != 4
        or k.shape[:3] != v.shape[:3]
        or len(v.shape) != 4
        or k.shape[2] != len(ids)
        or k.dtype != v.dtype
    ):
        raise CorruptBlockError(f"block {short} has K {k.shape} / V {v.shape} for {len(ids)} tokens")
    return hdr


def decode_block(buffer: bytes | bytearray | memoryview, *, expect_hash: str | None = None) -> Block:
    """Parse and check a block; the tensors are views of ``buffer`` (no copy)."""
    view = memoryview(buffer)
    hdr = parse_block_header(view, len(view))
    if expect_hash is not None and hdr.hash != expect_hash:
        raise CorruptBlockError(f"block file holds {hdr.hash[:12]}, expected {expect_hash[:12]}")
    hasher = hdr.hasher()
    hasher.update(view[hdr.data_offset :])
    hdr.check(hasher)
    tensors = {}
    for name, spec in (("k", hdr.k), ("v", hdr.v)):
        count = (spec.end - spec.begin) // spec.dtype.itemsize
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffers: the tensors are never written
            t = (  # device: a block is read from host bytes (the store moves a lookup's result)
                torch.frombuffer(buffer, dtype=spec.dtype, count=count, offset=hdr.data_offset + spec.begin)
                if count
                else torch.empty(0, dtype=spec.dtype, device="cpu")
            )
        tensors[name] = t.reshape(spec.shape)
    return hdr.block(tensors["k"], tensors["v"])
