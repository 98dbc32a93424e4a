"""Mutations of snapshot files, shared by the property tests and ``benchmarks/fuzz_snapshot.py``.

Each mutation takes the bytes of a valid snapshot file and returns other bytes: bit flips, byte
overwrites in the header, truncations, appended garbage, header field edits (digest left stale), and
forged files whose digest is *recomputed* over an invalid schema (int8 or complex-like values, mixed
dtypes, NaN, negative or float positions, out-of-vocabulary ids, empty caches, missing layers). The
loader must answer each with a kvlab error or the identical snapshot.

A forgery with a recomputed digest over a *valid* schema is out of scope by construction: nothing in
the file can tell it from a genuine one (see docs/snapshots.md).
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from kvlab.cache.io import load_snapshot, save_snapshot, snapshot_digest
from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import KvlabError
from kvlab.rope.spec import RopeSpec

VOCAB = 100


def small_snapshot(seed: int = 0, layers: int = 2, tokens: int = 6) -> KVSnapshot:
    """A tiny valid snapshot (no model needed): 2 layers x [1, 2, 6, 8] fp32 with a default RoPE."""
    g = torch.Generator().manual_seed(seed)
    head_dim = 8
    rope = RopeSpec(
        inv_freq=tuple(10000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)),
        head_dim=head_dim,
        theta=10000.0,
    )
    return KVSnapshot(
        keys=tuple(torch.randn(1, 2, tokens, head_dim, generator=g, device="cpu") for _ in range(layers)),
        values=tuple(torch.randn(1, 2, tokens, head_dim, generator=g, device="cpu") for _ in range(layers)),
        token_ids=torch.randint(0, VOCAB, (1, tokens), generator=g, device="cpu"),
        positions=torch.arange(tokens, device="cpu"),
        rope=rope,
        fingerprint="ab" * 32,
        model_name="tiny",
        provenance="prefill",
    )


def same_snapshot(a: KVSnapshot, b: KVSnapshot) -> bool:
    """Bit-identical content: tensors (dtype, shape, bytes), ids, positions, RoPE and labels."""

    def eq(x: torch.Tensor, y: torch.Tensor) -> bool:
        return (
            x.dtype == y.dtype
            and x.shape == y.shape
            and bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
        )

    return (
        len(a.keys) == len(b.keys)
        and all(eq(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True))
        and eq(a.token_ids, b.token_ids)
        and eq(a.positions, b.positions)
        and (a.rope.to_json() if a.rope else None) == (b.rope.to_json() if b.rope else None)
        and (a.fingerprint, a.model_name, a.provenance) == (b.fingerprint, b.model_name, b.provenance)
    )


def split_file(data: bytes) -> tuple[dict, dict, bytes]:
    """(safetensors header, kvlab metadata, tensor data) of a valid file."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["kvlab"]), data[8 + n :]


def join_file(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def forge(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """A file with ``meta`` and ``tensors`` and a digest recomputed over both (what a forger can do)."""
    meta = dict(meta)
    meta["digest"] = snapshot_digest(meta, tensors)
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"kvlab": json.dumps(meta)})


def tensors_of(snap: KVSnapshot) -> dict[str, torch.Tensor]:
    from kvlab.cache.io import _tensors

    return _tensors(snap)


_WEIRD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    3,
    2**31,
    2**64,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "2",
    [],
    [1],
    {},
    {"a": 1},
]


def mutate_header_field(meta: dict, rng: random.Random) -> dict:
    """One metadata field (possibly nested in the RoPE spec) changed, added or removed."""
    meta = json.loads(json.dumps(meta))
    target = meta
    if meta.get("rope") and rng.random() < 0.4:
        target = meta["rope"]
    key = rng.choice(sorted(target))
    op = rng.random()
    if op < 0.1:
        del target[key]
    elif op < 0.15:
        target["extra_" + str(rng.randint(0, 9))] = rng.choice(_WEIRD)
    elif isinstance(target[key], int) and not isinstance(target[key], bool) and op < 0.6:
        target[key] += rng.choice([-2, -1, 1, 2, 100])
    elif isinstance(target[key], list) and target[key] and op < 0.6:
        i = rng.randrange(len(target[key]))
        target[key][i] = target[key][i] * rng.choice([0.9, 1.1, -1, 0]) if rng.random() < 0.8 else "x"
    elif isinstance(target[key], str) and op < 0.6:
        s = target[key]
        target[key] = (s[:-1] + rng.choice("0aZ")) if s else "z"
    else:
        target[key] = rng.choice(_WEIRD)
    return meta


FORGE_KINDS = (
    "int8 values",
    "int64 values",
    "mixed dtypes",
    "nan",
    "inf",
    "negative position",
    "float positions",
    "out-of-vocab id",
    "negative id",
    "empty cache",
    "missing layer",
    "extra tensor",
    "shape mismatch",
    "geometry lie",
    "prefill with gaps",
    "bad rope",
    "bad provenance",
)


def forge_invalid(snap: KVSnapshot, rng: random.Random, kind: str | None = None) -> tuple[str, bytes]:
    """A forged file (digest recomputed) that breaks the schema in one of several ways; returns (kind, bytes)."""
    t = tensors_of(snap)
    data = save_snapshot_bytes(snap)
    _, meta, _ = split_file(data)
    meta = {k: v for k, v in meta.items() if k != "digest"}
    kind = kind or rng.choice(FORGE_KINDS)
    i = rng.randrange(snap.num_layers)
    name = rng.choice([f"k.{i}", f"v.{i}"])
    if kind == "int8 values":
        t[name] = (t[name] * 10).to(torch.int8)
    elif kind == "int64 values":
        t[name] = t[name].to(torch.int64)
    elif kind == "mixed dtypes":
        t[name] = t[name].to(torch.float16)
    elif kind == "nan":
        t[name] = (
            t[name]
            .clone()
            .reshape(-1)
            .index_fill(
                0, torch.tensor([rng.randrange(t[name].numel())], device=t[name].device), float("nan")
            )
            .reshape(t[name].shape)
        )
    elif kind == "inf":
        t[name] = (
            t[name]
            .clone()
            .reshape(-1)
            .index_fill(0, torch.tensor([0], device=t[name].device), float("inf"))
            .reshape(t[name].shape)
        )
    elif kind == "negative position":
        meta["provenance"] = "edited"
        t["positions"] = t["positions"].clone()
        t["positions"][rng.randrange(snap.seq_len)] = -rng.randint(1, 50)
    elif kind == "float positions":
        t["positions"] = t["positions"].double() + 0.5
    elif kind == "out-of-vocab id":
        t["token_ids"] = t["token_ids"].clone()
        t["token_ids"][0, rng.randrange(snap.seq_len)] = rng.choice([VOCAB, VOCAB + 7, 2**40])
    elif kind == "negative id":
        t["token_ids"] = t["token_ids"].clone()
        t["token_ids"][0, 0] = -1
    elif kind == "empty cache":
        for k in list(t):
            t[k] = t[k][..., :0, :] if k.startswith(("k.", "v.")) else t[k][..., :0]
        meta["seq_len"] = 0
    elif kind == "missing layer":
        del t[f"k.{snap.num_layers - 1}"], t[f"v.{snap.num_layers - 1}"]
    elif kind == "extra tensor":
        t["k.99"] = t["k.0"].clone()
    elif kind == "shape mismatch":
        t[name] = t[name][:, :, :, :-1]
    elif kind == "geometry lie":
        key = rng.choice(["num_layers", "num_kv_heads", "seq_len", "head_dim", "batch_size"])
        meta[key] += rng.choice([-1, 1])
    elif kind == "prefill with gaps":  # positions are free for an edited cache, not for a prefill
        meta["provenance"] = "prefill"
        t["positions"] = t["positions"] * 2
    elif kind == "bad rope":
        field = rng.choice(["pairing", "inv_freq", "head_dim", "attention_scaling"])
        meta["rope"] = dict(meta["rope"])
        meta["rope"][field] = {"pairing": "diagonal", "inv_freq": [], "head_dim": -8, "attention_scaling": 0}[
            field
        ]
    elif kind == "bad provenance":
        meta["provenance"] = "trust me"
    try:
        return kind, forge(t, meta)
    except (ValueError, TypeError) as exc:  # json cannot write it: forge a bare header edit instead
        raise AssertionError(f"cannot forge {kind}: {exc}") from exc


def save_snapshot_bytes(snap: KVSnapshot) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "s.kv.safetensors"
        save_snapshot(snap, p)
        return p.read_bytes()


def mutate(data: bytes, rng: random.Random, snap: KVSnapshot) -> tuple[str, bytes]:
    """One random mutation of a valid file's bytes; returns (kind, bytes)."""
    r = rng.random()
    n = int.from_bytes(data[:8], "little")
    if r < 0.25:
        pos = rng.randrange(len(data))
        return "bit flip", data[:pos] + bytes([data[pos] ^ (1 << rng.randrange(8))]) + data[pos + 1 :]
    if r < 0.40:
        pos = rng.randrange(8, 8 + n)
        return "header byte", data[:pos] + bytes([rng.randrange(32, 127)]) + data[pos + 1 :]
    if r < 0.50:
        return "truncation", data[: rng.randrange(len(data))]
    if r < 0.55:
        return "appended bytes", data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if r < 0.80:
        header, meta, body = split_file(data)
        header["__metadata__"] = {"kvlab": json.dumps(mutate_header_field(meta, rng))}
        return "header field edit", join_file(header, body)
    return forge_invalid(snap, rng)


def outcome(path: Path, original: KVSnapshot, **load_kw: Any) -> str:
    """'rejected', 'identical', 'DIFFERENT' (accepted with other content) or 'CRASH <Exception>'."""
    try:
        got = load_snapshot(path, expect_vocab_size=VOCAB, **load_kw)
    except KvlabError:
        return "rejected"
    except Exception as exc:  # noqa: BLE001 - the point is to count these
        return f"CRASH {type(exc).__name__}"
    return "identical" if same_snapshot(got, original) else "DIFFERENT"
