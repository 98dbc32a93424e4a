"""Saving and loading snapshots: one safetensors file, JSON metadata in its header, atomic writes.

Layout: tensors ``k.<layer>``, ``v.<layer>``, ``token_ids``, ``positions``; the header's
``kvlab`` entry is JSON with the format version, model fingerprint and name, RoPE spec, and a
sha256 of every tensor's bytes so a flipped bit is caught on load. Writes go to a temporary file in
the same directory, are fsync'ed, then renamed over the target: a reader sees the old file or the
new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import IncompatibleCacheError, SnapshotFileError
from kvlab.rope.spec import RopeSpec

FORMAT = "kvlab.snapshot"
FORMAT_VERSION = 1


def _tensors(snapshot: KVSnapshot) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(snapshot.keys, snapshot.values, strict=True)):
        out[f"k.{i}"] = k.detach().to("cpu").contiguous()
        out[f"v.{i}"] = v.detach().to("cpu").contiguous()
    out["token_ids"] = snapshot.token_ids.to("cpu", torch.int64).contiguous()
    out["positions"] = snapshot.positions.to("cpu", torch.int64).contiguous()
    return out


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of the tensors, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, fsync, then rename over ``path``: readers see the old or the new file.

    On any failure (including an interrupted write) the temporary file is removed and ``path`` is
    left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def save_snapshot(snapshot: KVSnapshot, path: str | Path) -> Path:
    """Write ``snapshot`` to ``path`` (conventionally ``*.kv.safetensors``) atomically; returns the path."""
    path = Path(path)
    tensors = _tensors(snapshot)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": snapshot.fingerprint,
        "model_name": snapshot.model_name,
        "rope": snapshot.rope.to_json() if snapshot.rope else None,
        "num_layers": snapshot.num_layers,
        "provenance": snapshot.provenance,
        "sha256": tensors_digest(tensors),
    }
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"kvlab": json.dumps(meta)}))
    return path


def read_metadata(path: str | Path) -> dict:
    """The kvlab header of a snapshot file, without reading its tensors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100_000_000:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["kvlab"])
    except FileNotFoundError:
        raise SnapshotFileError(f"no snapshot file at {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotFileError(f"{path} is not a kvlab snapshot file (unreadable header: {exc})") from None
    if meta.get("format") != FORMAT:
        raise SnapshotFileError(f"{path} is not a kvlab snapshot file")
    if meta.get("version") != FORMAT_VERSION:
        raise SnapshotFileError(
            f"{path} has snapshot format version {meta.get('version')}, this kvlab reads {FORMAT_VERSION}"
        )
    return meta


def load_snapshot(
    path: str | Path,
    *,
    expect_fingerprint: str | None = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
) -> KVSnapshot:
    """Read a snapshot written by :func:`save_snapshot`.

    Raises :class:`SnapshotFileError` for a missing, truncated or corrupt file (checksum mismatch when
    ``verify``), and :class:`IncompatibleCacheError` if ``expect_fingerprint`` names another model.
    """
    path = Path(path)
    meta = read_metadata(path)
    if expect_fingerprint is not None and meta["fingerprint"] != expect_fingerprint:
        raise IncompatibleCacheError(
            f"{path} was made by model {meta.get('model_name') or '?'} ({meta['fingerprint'][:12]}), "
            f"not by the loaded model ({expect_fingerprint[:12]})"
        )
    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise SnapshotFileError(f"{path} is truncated or corrupt ({exc})") from None
    if verify and tensors_digest(tensors) != meta.get("sha256"):
        raise SnapshotFileError(f"{path} is corrupt: its tensors do not match the checksum in its header")
    n = int(meta["num_layers"])
    try:
        keys = tuple(tensors[f"k.{i}"].to(device) for i in range(n))
        values = tuple(tensors[f"v.{i}"].to(device) for i in range(n))
        token_ids, positions = tensors["token_ids"], tensors["positions"]
    except KeyError as exc:
        raise SnapshotFileError(f"{path} is missing tensor {exc}") from None
    return KVSnapshot(
        keys=keys,
        values=values,
        token_ids=token_ids,
        positions=positions,
        rope=RopeSpec.from_json(meta["rope"]) if meta.get("rope") else None,
        fingerprint=meta["fingerprint"],
        model_name=meta.get("model_name", ""),
        provenance=meta.get("provenance", "unknown"),
    )
