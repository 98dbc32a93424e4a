"""Mutations of stored blocks, shared by ``tests/test_store_fuzz.py`` and ``benchmarks/fuzz_store.py``.

A mutated block file is put where the disk tier expects it, then read back the two ways kvlab reads
blocks: ``decode_block`` (``store get``, ``verify``) and a store lookup (the direct ``read_into``
path). Each outcome is classified: the mutation was refused (an error or a miss), the block came
back identical, or — the outcome that must never happen — it came back *different*, or the reader
raised something other than a kvlab error.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from kvlab.errors import KvlabError
from kvlab.store.block import Block, decode_block, encode_block
from kvlab.store.keys import Namespace, block_hash

REFUSED, IDENTICAL, DIFFERENT, CRASH = "refused", "identical", "DIFFERENT", "CRASH"
KINDS = ("bit flip", "byte set", "truncation", "appended bytes", "header edit", "swapped block")


@dataclass(frozen=True)
class Sample:
    namespace: Namespace
    blocks: tuple[Block, ...]  # a chain: blocks[i].parent == blocks[i-1].hash
    ids: tuple[int, ...]


def make_sample(seed: int = 0, *, block_tokens: int = 4, n_blocks: int = 3) -> Sample:
    """A small chain of real blocks (2 layers, 2 KV heads, head dim 8, float32)."""
    g = torch.Generator().manual_seed(seed)
    ns = Namespace(
        fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=block_tokens, geometry=(2, 2, 8)
    )
    ids = tuple(int(t) for t in torch.randint(0, 1000, (block_tokens * n_blocks,), generator=g, device="cpu"))
    parent, blocks = ns.root, []
    for i in range(n_blocks):
        chunk = ids[i * block_tokens : (i + 1) * block_tokens]
        h = block_hash(parent, chunk)
        blocks.append(
            Block(
                hash=h,
                parent=parent,
                namespace=ns.root,
                start=i * block_tokens,
                token_ids=chunk,
                keys=torch.randn(2, 2, block_tokens, 8, generator=g, device="cpu"),
                values=torch.randn(2, 2, block_tokens, 8, generator=g, device="cpu"),
                namespace_info=ns.info(),
            )
        )
        parent = h
    return Sample(ns, tuple(blocks), ids)


def mutate(data: bytes, rng: random.Random, other: bytes) -> tuple[str, bytes]:
    """One random mutation of an encoded block; returns (kind, mutated bytes)."""
    kind = rng.choice(KINDS)
    b = bytearray(data)
    header_end = 8 + int.from_bytes(data[:8], "little")
    if kind == "bit flip":
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "byte set":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "truncation":
        b = b[: rng.randrange(len(b))]
    elif kind == "appended bytes":
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "header edit":
        # valid JSON, one field changed: the checksum no longer matches (or does, if recomputed)
        try:
            meta = json.loads(bytes(b[8:header_end]))
            key = rng.choice(sorted(meta))
            meta[key] = rng.choice([None, 0, -1, 1, 2**40, "x", [], {}, 1.5, meta[key]])
            raw = json.dumps(meta).encode()
            b = bytearray(len(raw).to_bytes(8, "little") + raw + bytes(b[header_end:]))
        except Exception:  # the header itself may not parse; then flip a header byte instead
            b[rng.randrange(8, max(9, min(header_end, len(b))))] ^= 0xFF
    else:  # swapped block: another block's (valid) bytes filed under this name
        b = bytearray(other)
    return kind, bytes(b)


def same_block(a: Block, b: Block) -> bool:
    return (
        a.hash == b.hash
        and a.parent == b.parent
        and a.namespace == b.namespace
        and a.start == b.start
        and tuple(a.token_ids) == tuple(b.token_ids)
        and a.keys.dtype == b.keys.dtype
        and a.keys.shape == b.keys.shape
        and torch.equal(a.keys, b.keys)
        and torch.equal(a.values, b.values)
    )


def classify_decode(data: bytes, original: Block) -> str:
    """Outcome of ``decode_block`` on mutated bytes filed under ``original``'s name."""
    try:
        got = decode_block(data, expect_hash=original.hash)
    except KvlabError:
        return REFUSED
    except Exception:  # noqa: BLE001 - the point is to catch anything else
        return CRASH
    return IDENTICAL if same_block(got, original) else DIFFERENT


def encoded(sample: Sample) -> list[bytes]:
    return [encode_block(b) for b in sample.blocks]


def classify_lookup(store, sample: Sample, victim: int) -> str:
    """Outcome of a store lookup of the whole chain after block ``victim``'s file was mutated: every
    token served must carry exactly the original K/V (a shorter match is a refusal of the rest)."""
    try:
        m = store.lookup(list(sample.ids), sample.namespace)
    except KvlabError:
        return REFUSED
    except Exception:  # noqa: BLE001
        return CRASH
    if m.snapshot is None or m.cached_tokens == 0:
        return REFUSED
    n = m.cached_tokens
    want_k = torch.cat([b.keys for b in sample.blocks], dim=2)[:, :, :n]
    want_v = torch.cat([b.values for b in sample.blocks], dim=2)[:, :, :n]
    got_k = torch.stack([k[0] for k in m.snapshot.keys])
    got_v = torch.stack([v[0] for v in m.snapshot.values])
    if got_k.shape != want_k.shape or not (torch.equal(got_k, want_k) and torch.equal(got_v, want_v)):
        return DIFFERENT
    if list(m.snapshot.token_list()) != list(sample.ids[:n]):
        return DIFFERENT
    full = len(sample.ids)
    return IDENTICAL if n == full else REFUSED
