"""One stored block: the K/V of up to ``block_tokens`` consecutive tokens, and its byte format.

A block's bytes are a valid safetensors file holding ``k`` and ``v``, each
``[layers, kv_heads, n, head_dim]``; the header's ``kvlab_block`` entry is JSON with the block's
hash, parent, namespace root, token ids, start position and a CRC-32 over that JSON and the tensor
bytes. :func:`decode_block` verifies the checksum and that the block is the one asked for, so a torn,
flipped or misplaced block is never used. Decoded tensors are read-only views of the buffer they
came from (an ``mmap`` or a ``bytes`` object, kept alive by the tensors).
"""

from __future__ import annotations

import json
import warnings
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import save

from kvlab.store.errors import CorruptBlockError

BLOCK_FORMAT = "kvlab.block"
BLOCK_VERSION = 1

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass(frozen=True, eq=False)
class Block:
    """K/V of tokens ``start .. start + len(token_ids) - 1`` of a cached prefix.

    Attributes:
        keys / values: ``[layers, kv_heads, n, head_dim]`` (keys post-RoPE at positions ``start..``).
        token_ids: the ``n`` token ids (``n`` < block size only for a partial, last block).
        hash / parent: this block's chained hash and its parent's (the namespace root for block 0).
        namespace_info: the namespace's fields (fingerprint, dtype, RoPE, model name), so a prefix can be
            rebuilt as a snapshot from the store alone.
    """

    hash: str
    parent: str
    namespace: str
    start: int
    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    namespace_info: dict | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def _meta(block: Block) -> dict:
    return {
        "format": BLOCK_FORMAT,
        "version": BLOCK_VERSION,
        "hash": block.hash,
        "parent": block.parent,
        "namespace": block.namespace,
        "start": block.start,
        "token_ids": list(block.token_ids),
        "ns": block.namespace_info,
    }


def _digest(meta: dict, data: memoryview | bytes) -> str:
    """CRC-32 of the metadata JSON and the tensor bytes.

    The checksum guards against accidental damage (bit rot, truncation, a stray write), which CRC-32
    detects at ~3.5 GB/s here, twice sha256's speed. It is not a defence against a malicious writer;
    no unkeyed checksum is, since the writer can recompute it.
    """
    crc = zlib.crc32(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    return f"crc32:{zlib.crc32(data, crc):08x}"


def encode_block(block: Block) -> bytes:
    """The block as safetensors bytes with a self-checking header."""
    tensors = {"k": block.keys.detach().cpu().contiguous(), "v": block.values.detach().cpu().contiguous()}
    meta = _meta(block)
    raw = save(tensors, metadata={"kvlab_block": json.dumps(meta)})
    n = int.from_bytes(raw[:8], "little")
    meta["checksum"] = _digest(meta, memoryview(raw)[8 + n :])
    return save(tensors, metadata={"kvlab_block": json.dumps(meta)})


def read_block_meta(buffer: bytes | memoryview) -> tuple[dict, dict, int]:
    """``(kvlab meta, safetensors header, data offset)`` of a block buffer; raises CorruptBlockError."""
    view = memoryview(buffer)
    try:
        n = int.from_bytes(view[:8], "little")
        if n <= 0 or 8 + n > len(view):
            raise ValueError("bad header length")
        header = json.loads(bytes(view[8 : 8 + n]))
        meta = json.loads(header["__metadata__"]["kvlab_block"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptBlockError(f"unreadable block header ({exc})") from None
    if meta.get("format") != BLOCK_FORMAT or meta.get("version") != BLOCK_VERSION:
        raise CorruptBlockError(
            f"not a kvlab block (format {meta.get('format')!r} version {meta.get('version')!r})"
        )
    return meta, header, 8 + n


def decode_block(buffer: bytes | memoryview, *, expect_hash: str | None = None, verify: bool = True) -> Block:
    """Parse and check a block; the tensors are views of ``buffer`` (no copy)."""
    meta, header, offset = read_block_meta(buffer)
    view = memoryview(buffer)
    data = view[offset:]
    if expect_hash is not None and meta.get("hash") != expect_hash:
        raise CorruptBlockError(f"block file holds {str(meta.get('hash'))[:12]}, expected {expect_hash[:12]}")
    if verify:
        claimed = meta.pop("checksum", None)
        if claimed is None or _digest(meta, data) != claimed:
            raise CorruptBlockError(f"block {str(meta.get('hash'))[:12]} failed its checksum")
    tensors = {}
    try:
        for name in ("k", "v"):
            info = header[name]
            dtype = _DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            count = (end - begin) // torch.empty((), dtype=dtype).element_size()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffers: the tensors are never written
                t = (
                    torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset + begin)
                    if count
                    else torch.empty(0, dtype=dtype)
                )
            tensors[name] = t.reshape(info["shape"])
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise CorruptBlockError(f"block {str(meta.get('hash'))[:12]} has malformed tensors ({exc})") from None
    ids = tuple(int(t) for t in meta["token_ids"])
    k, v = tensors["k"], tensors["v"]
    if k.ndim != 4 or k.shape != v.shape[:3] + k.shape[3:] or k.shape[2] != len(ids):
        raise CorruptBlockError(
            f"block {meta['hash'][:12]} has K {tuple(k.shape)} / V {tuple(v.shape)} for {len(ids)} tokens"
        )
    return Block(
        hash=meta["hash"],
        parent=meta["parent"],
        namespace=meta["namespace"],
        start=int(meta["start"]),
        token_ids=ids,
        keys=k,
        values=v,
        namespace_info=meta.get("ns"),
    )
