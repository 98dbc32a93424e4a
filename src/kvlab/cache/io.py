"""Saving and loading snapshots: one safetensors file, authenticated JSON metadata, atomic writes.

Layout (format version 2): tensors ``k.<layer>``, ``v.<layer>``, ``token_ids``, ``positions``; the
header's ``kvlab`` entry is JSON with the format version, model fingerprint and name, RoPE spec,
provenance and geometry, plus a ``digest``: sha256 over the canonical JSON of every other metadata
field *and* every tensor's name, dtype, shape and bytes. A flipped bit anywhere, in a tensor or in
``num_layers``, ``inv_freq``, ``pairing`` or the fingerprint, is a :class:`SnapshotFileError`.

The loader also validates the whole schema (types, ranges, one float dtype, per-layer shapes that
match the declared geometry, integer non-negative positions, token ids within the vocabulary when
known, finite values, a non-empty cache) and raises only :class:`SnapshotFileError` for a bad file,
so a file that a forger re-digested still cannot smuggle int8 values or NaN into a cache. It refuses
anything that is not a regular file before reading it (a FIFO would block forever).

Writes go to a uniquely named temporary file in the same folder (``.<name>.<pid>.<random>.kvlab.tmp``),
are fsync'ed, then renamed over the target: a reader sees the old file or the new one, never half of
one. A writer killed with SIGKILL leaves its temp file behind; :func:`clean_temp_files` (``kvlab gc``)
removes those, and every save removes the leftovers of dead writers of the same target.

Version 1 files (whose checksum covered the tensors only) are refused by default; pass
``allow_v1=True`` to read one (tensor checksum and full schema validation, provenance forced to
``"unknown"`` since its metadata is unauthenticated) and save it again to upgrade it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from kvlab.cache.handle_view import HandleView
from kvlab.cache.snapshot import PROVENANCES, KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError, KvlabError, SnapshotFileError
from kvlab.rope.spec import rope_from_json

FORMAT = "kvlab.snapshot"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
TEMP_SUFFIX = ".kvlab.tmp"  # ends in .tmp: the store's own temp sweep sees these too
# .<target name>.<writer pid>.<random>.kvlab.tmp ; the random part is tempfile's 8 characters.
_TEMP_RE = re.compile(
    r"^\.(?P<name>.+)\.(?P<pid>\d+)\.(?P<rand>[a-z0-9_]{8})" + re.escape(TEMP_SUFFIX) + r"$"
)
_DIGEST_DOMAIN = b"kvlab.snapshot/2\n"
_MAX_HEADER = 100_000_000
_MAX_POSITION = 2**40
_MAX_TOKEN_ID = 2**31
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_TORCH_DTYPES = {**_FLOAT_DTYPES, "I64": torch.int64}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8}
_V2_KEYS = frozenset(
    {
        "format",
        "version",
        "fingerprint",
        "model_name",
        "rope",
        "num_layers",
        "batch_size",
        "num_kv_heads",
        "seq_len",
        "head_dim",
        "value_head_dim",
        "dtype",
        "provenance",
        "digest",
    }
)
_V1_KEYS = frozenset(
    {"format", "version", "fingerprint", "model_name", "rope", "num_layers", "provenance", "sha256"}
)


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
            # numpy's stubs make ndarray a Buffer only for Python >= 3.12; it is one at runtime
            h.update(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def canonical_json(meta: dict) -> str:
    """The metadata as the digest sees it: sorted keys, no spaces, no NaN (equal values, equal text)."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def snapshot_digest(meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 binding the metadata (every field but ``digest``) to the tensors."""
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(canonical_json({k: v for k, v in meta.items() if k != "digest"}).encode())
    h.update(b"\n")
    h.update(tensors_digest(tensors).encode())
    return h.hexdigest()


# -- writing ------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's) or cannot tell: assume alive
    return True


def clean_temp_files(
    folder: str | Path, *, older_than: float = 3600.0, name: str | None = None, dead_writers: bool = False
) -> list[Path]:
    """Remove kvlab's own leftover temp files (``.<name>.<pid>.<random>.kvlab.tmp``) in ``folder``.

    A temp file is removed when it is older than ``older_than`` seconds, or (``dead_writers=True``)
    when the process that was writing it no longer runs on this machine. Only regular files matching
    kvlab's pattern are touched (``name`` restricts to temps of one target file); nothing else in the
    folder is, and the folder is not recursed into. Returns the removed paths.
    """
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
        raise BadInputError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise SnapshotFileError(f"{folder} is not a folder")
    now = time.time()
    removed: list[Path] = []
    for entry in os.scandir(folder):
        m = _TEMP_RE.match(entry.name)
        if not m or (name is not None and m.group("name") != name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        stale = now - st.st_mtime >= older_than or (dead_writers and not _pid_alive(int(m.group("pid"))))
        if stale:
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except FileNotFoundError:
                pass
    return removed


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)``, fsync, then rename over ``path``: readers see the old or the new file.

    The temp file has a unique name in the target's folder (``.<name>.<pid>.<random>.kvlab.tmp``). On
    any Python-level failure it is removed and ``path`` is left as it was; a SIGKILL leaves it behind
    for :func:`clean_temp_files` (the next :func:`save_snapshot` of the same target removes it too).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{path.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=path.parent
    )
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


def _meta_for(snapshot: KVSnapshot, tensors: dict[str, torch.Tensor]) -> dict:
    dtype = str(snapshot.dtype).replace("torch.", "")
    if dtype not in _DTYPE_NAMES:
        raise SnapshotFileError(
            f"cannot save a cache of dtype {dtype}; kvlab snapshots hold {', '.join(_DTYPE_NAMES)}"
        )
    if snapshot.seq_len == 0:
        raise SnapshotFileError("cannot save an empty cache")
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fingerprint": snapshot.fingerprint,
        "model_name": snapshot.model_name,
        "rope": snapshot.rope.to_json() if snapshot.rope else None,
        "num_layers": snapshot.num_layers,
        "batch_size": snapshot.batch_size,
        "num_kv_heads": snapshot.num_kv_heads,
        "seq_len": snapshot.seq_len,
        "head_dim": snapshot.head_dim,
        "value_head_dim": int(snapshot.values[0].shape[3]),
        "dtype": dtype,
        "provenance": snapshot.provenance,
    }
    meta["digest"] = snapshot_digest(meta, tensors)
    return meta


def save_snapshot(snapshot: KVSnapshot, path: str | Path) -> Path:
    """Write ``snapshot`` to ``path`` (conventionally ``*.kv.safetensors``) atomically; returns the path."""
    path = Path(path)
    snapshot.require_unmasked("saving a snapshot file")  # the file format has no mask: refuse, lose nothing
    tensors = _tensors(snapshot)
    meta = _meta_for(snapshot, tensors)
    _check_meta(meta, f"the snapshot to save to {path}")  # what we write must be what we would read
    try:
        _check_values(tensors, meta, path, None, allow_nonfinite=True)
    except SnapshotFileError as exc:
        raise BadInputError(f"cannot save this snapshot: {exc}") from None
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"kvlab": json.dumps(meta)}))
    with contextlib.suppress(OSError, SnapshotFileError):  # leftovers of killed writers of this target
        clean_temp_files(path.parent, name=path.name, dead_writers=True)
    return path


# -- reading ------------------------------------------------------------------------------------------
class _Bad(Exception):
    """A validation finding; turned into SnapshotFileError with the file's name."""


def _int(meta: dict, key: str, lo: int, hi: int = 2**31) -> int:
    v = meta.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"'{key}' must be an integer in [{lo}, {hi}], got {v!r:.60}")
    return v


def _str(meta: dict, key: str, max_len: int, *, empty: bool = True) -> str:
    v = meta.get(key)
    if not isinstance(v, str) or len(v) > max_len or (not empty and not v):
        raise _Bad(f"'{key}' must be a {'' if empty else 'non-empty '}string of at most {max_len} characters")
    return v


def _check_meta(meta: Any, where: str) -> dict:
    """Validate the kvlab header (types and ranges); raises SnapshotFileError."""
    try:
        if not isinstance(meta, dict):
            raise _Bad("its kvlab metadata is not a JSON object")
        if meta.get("format") != FORMAT:
            raise _Bad("it is not a kvlab snapshot file")
        version = meta.get("version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise _Bad(f"it has snapshot format version {version!r:.20}, this kvlab reads {FORMAT_VERSION}")
        keys = _V2_KEYS if version == 2 else _V1_KEYS
        extra, missing = set(meta) - keys, keys - set(meta)
        if version == 1:
            missing -= {"provenance", "model_name", "rope"}
        if extra or missing:
            raise _Bad(
                f"its metadata has {'unknown fields ' + ', '.join(sorted(extra)) if extra else ''}"
                f"{'; ' if extra and missing else ''}{'missing fields ' + ', '.join(sorted(missing)) if missing else ''}"
            )
        _str(meta, "fingerprint", 256, empty=False)
        if meta.get("model_name") is not None:
            _str(meta, "model_name", 4096)
        _int(meta, "num_layers", 1, 100_000)
        if meta.get("provenance", "unknown") not in PROVENANCES:
            raise _Bad(f"'provenance' must be one of {', '.join(PROVENANCES)}")
        if meta.get("rope") is not None:
            per_layer = getattr(rope_from_json(meta["rope"]), "layers", None)  # raises BadInputError
            if per_layer is not None and len(per_layer) != meta["num_layers"]:
                raise _Bad(f"its per-layer RoPE covers {len(per_layer)} layers, not {meta['num_layers']}")
        digest_key = "digest" if version == 2 else "sha256"
        d = meta.get(digest_key)
        if not isinstance(d, str) or not re.fullmatch(r"[0-9a-f]{64}", d):
            raise _Bad(f"'{digest_key}' must be 64 hex digits")
        if version == 2:
            for key in ("batch_size", "num_kv_heads", "seq_len", "head_dim", "value_head_dim"):
                _int(meta, key, 1)
            if meta["dtype"] not in _DTYPE_NAMES:
                raise _Bad(f"'dtype' must be one of {', '.join(_DTYPE_NAMES)}, got {meta['dtype']!r:.40}")
            if meta["rope"] is not None:
                rope = rope_from_json(meta["rope"])
                if rope.head_dim != meta["head_dim"]:
                    raise _Bad(
                        f"its RoPE head_dim {rope.head_dim} differs from the cache's head_dim {meta['head_dim']}"
                    )
            canonical_json(meta)
    except _Bad as exc:
        raise SnapshotFileError(f"{where} is not a valid kvlab snapshot: {exc}") from None
    except (KvlabError, ValueError, TypeError) as exc:
        raise SnapshotFileError(f"{where} is not a valid kvlab snapshot: {exc}") from None
    return meta


def _open_regular(path: Path) -> int:
    """An fd of ``path`` opened without blocking, or SnapshotFileError if it is not a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SnapshotFileError(f"no snapshot file at {path}") from None
    except OSError as exc:
        raise SnapshotFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotFileError(
            f"{path} is not a regular file (a folder, FIFO or device); refusing to read it"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise SnapshotFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between stat and open
        os.close(fd)
        raise SnapshotFileError(f"{path} is not a regular file; refusing to read it")
    return fd


def _read_header(fd: int, path: Path) -> tuple[dict, dict, int]:
    """(kvlab metadata, tensor entries, data offset) of an open file, checked for consistency."""
    size = os.fstat(fd).st_size
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise _Bad("it is shorter than a safetensors header")
            n = int.from_bytes(raw, "little")
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise _Bad(f"its header length {n} does not fit a {size}-byte file")
            text = f.read(n)
        header = loads_bounded(
            text.decode("utf-8"),
            max_bytes=_MAX_HEADER,
            parse_constant=_reject_constant,
            object_pairs_hook=_no_duplicates,
        )
        if not isinstance(header, dict):
            raise _Bad("its header is not a JSON object")
        extra = header.get("__metadata__")
        if not isinstance(extra, dict) or set(extra) != {"kvlab"} or not isinstance(extra["kvlab"], str):
            raise _Bad("its header has no kvlab metadata")
        meta = loads_bounded(
            extra["kvlab"],
            max_bytes=_MAX_HEADER,
            parse_constant=_reject_constant,
            object_pairs_hook=_no_duplicates,
        )
    except _Bad as exc:
        raise SnapshotFileError(f"{path} is not a kvlab snapshot file ({exc})") from None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SnapshotFileError(f"{path} is not a kvlab snapshot file (unreadable header: {exc})") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    _check_layout(entries, size - 8 - n, path)
    return meta, entries, 8 + n


MAX_JSON_DEPTH = 32  # kvlab's own headers nest 6 levels at most (a per-layer RoPE spec inside a record)


def loads_bounded(
    text: str | bytes, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH, **kwargs: Any
) -> Any:
    """``json.loads`` for JSON read from files or servers that may be hostile (headers, index entries).

    At most ``max_bytes`` long and nested at most ``max_depth`` levels (``{}`` is one); anything else,
    including a nesting deep enough to hit Python's recursion limit, raises ``ValueError`` (which
    ``json.JSONDecodeError`` and ``UnicodeDecodeError`` are too), so a ``RecursionError`` never escapes.
    ``kwargs`` go to ``json.loads``.
    """
    if len(text) > max_bytes:
        raise ValueError(f"{len(text):,} bytes of JSON, over the {max_bytes:,} allowed here")
    try:
        doc = json.loads(text, **kwargs)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:  # iterative: a depth check must not recurse either
        node, depth = stack.pop()
        kids = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if kids is None:
            continue
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        stack.extend((k, depth + 1) for k in kids if isinstance(k, dict | list))
    return doc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a JSON object repeats a key")
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a snapshot header")


def _check_layout(entries: dict, data_len: int, path: Path) -> None:
    """Every tensor entry well-typed, its byte range matching dtype x shape, ranges tiling the data."""
    spans = []
    try:
        for name, e in entries.items():
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                raise _Bad(f"tensor entry {name!r:.40} is malformed")
            dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if dt not in _ITEMSIZE:
                raise _Bad(
                    f"tensor {name!r:.40} has dtype {dt!r:.20}; snapshots hold F32/F16/BF16/F64 and I64 only"
                )
            if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 2**40 for s in shape):
                raise _Bad(f"tensor {name!r:.40} has a malformed shape")
            if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
                raise _Bad(f"tensor {name!r:.40} has malformed data offsets")
            nbytes = math.prod(shape) * _ITEMSIZE[dt]
            if not 0 <= offs[0] <= offs[1] or offs[1] - offs[0] != nbytes:
                raise _Bad(f"tensor {name!r:.40} has {offs[1] - offs[0]} bytes for shape {shape} {dt}")
            spans.append((offs[0], offs[1]))
        spans.sort()
        pos = 0
        for a, b in spans:
            if a != pos:
                raise _Bad("its tensor data has gaps or overlaps")
            pos = b
        if pos != data_len:
            raise _Bad(f"its tensors need {pos} bytes but the file holds {data_len} (truncated or padded)")
    except _Bad as exc:
        raise SnapshotFileError(f"{path} is truncated or corrupt: {exc}") from None


def _check_tensors(meta: dict, entries: dict, path: Path) -> None:
    """Tensor names, dtypes and shapes against the declared geometry (before reading any data)."""
    L = meta["num_layers"]
    expected = {f"{p}.{i}" for i in range(L) for p in ("k", "v")} | {"token_ids", "positions"}
    if set(entries) != expected:
        missing, extra = sorted(expected - set(entries))[:4], sorted(set(entries) - expected)[:4]
        raise SnapshotFileError(
            f"{path} does not hold the tensors its metadata declares ({L} layers): "
            f"missing {missing or 'none'}, unexpected {extra or 'none'}"
        )
    if meta["version"] == 1:
        dts = {entries[f"{p}.{i}"]["dtype"] for i in range(L) for p in ("k", "v")}
        k0 = entries["k.0"]["shape"]
        if len(dts) != 1 or len(k0) != 4:
            raise SnapshotFileError(f"{path} holds K/V of mixed dtypes or a malformed shape")
        B, H, T, D = k0
        Dv, dt = entries["v.0"]["shape"][3] if len(entries["v.0"]["shape"]) == 4 else -1, dts.pop()
    else:
        B, H, T, D, Dv = (
            meta[k] for k in ("batch_size", "num_kv_heads", "seq_len", "head_dim", "value_head_dim")
        )
        dt = _DTYPE_NAMES[meta["dtype"]]
    if dt not in _FLOAT_DTYPES:
        raise SnapshotFileError(f"{path} holds K/V of dtype {dt}; snapshots hold F32, F16, BF16 or F64")
    want = {"token_ids": ("I64", [B, T]), "positions": ("I64", [T])}
    for i in range(L):
        want[f"k.{i}"] = (dt, [B, H, T, D])
        want[f"v.{i}"] = (dt, [B, H, T, Dv])
    for name, (wdt, wshape) in want.items():
        e = entries[name]
        if e["dtype"] != wdt or e["shape"] != wshape:
            raise SnapshotFileError(
                f"{path}: tensor {name} is {e['dtype']} {e['shape']}, the metadata declares {wdt} {wshape}"
            )
    if min(B, H, T, D, Dv) < 1:
        raise SnapshotFileError(f"{path} holds an empty cache (shape [{B}, {H}, {T}, {D}])")
    if meta.get("rope") is not None and rope_from_json(meta["rope"]).head_dim != D:
        raise SnapshotFileError(f"{path}: its RoPE head_dim differs from the cache's head_dim {D}")


def _check_values(
    tensors: dict[str, torch.Tensor], meta: dict, path: Path, vocab: int | None, allow_nonfinite: bool
) -> None:
    pos, ids = tensors["positions"], tensors["token_ids"]
    if int(pos.min()) < 0 or int(pos.max()) > _MAX_POSITION:
        raise SnapshotFileError(f"{path} has positions outside [0, {_MAX_POSITION}]")
    if meta.get("provenance") == "prefill" and not torch.equal(
        pos, torch.arange(pos.numel(), device=pos.device)
    ):
        raise SnapshotFileError(f"{path} says it is a prefill but its positions are not 0..T-1")
    hi = vocab if vocab is not None else _MAX_TOKEN_ID
    if int(ids.min()) < 0 or int(ids.max()) >= hi:
        raise SnapshotFileError(
            f"{path} holds token ids {int(ids.min())}..{int(ids.max())}, outside the vocabulary [0, {hi})"
        )
    if not allow_nonfinite:
        for name, t in tensors.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise SnapshotFileError(f"{path}: tensor {name} holds NaN or infinite values")


def read_metadata(path: str | Path) -> dict:
    """The kvlab header of a snapshot file, schema-checked but not yet authenticated (no tensors read)."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        meta, entries, _ = _read_header(fd, path)
        _check_meta(meta, str(path))
        _check_tensors(meta, entries, path)
    finally:
        os.close(fd)
    return meta


def _check_model(meta: dict, entries: dict, model: HandleView, path: Path) -> None:
    facts = model.facts
    if meta["fingerprint"] != model.fingerprint:
        raise IncompatibleCacheError(
            f"{path} was made by model {meta.get('model_name') or '?'} ({meta['fingerprint'][:12]}), "
            f"not by {model.name} ({model.fingerprint[:12]})"
        )
    k0, v0 = entries["k.0"], entries["v.0"]
    # _check_tensors made every layer's K and V agree with these (and V's heads with K's)
    mine = (meta["num_layers"], k0["shape"][1], k0["shape"][3], v0["shape"][3], k0["dtype"])
    theirs = (
        facts.num_layers,
        facts.num_kv_heads,
        facts.head_dim,
        getattr(facts, "value_head_dim", None) or facts.head_dim,  # kvlab's models: V's head size is K's
        _DTYPE_NAMES.get(str(model.dtype)[6:], "?"),
    )
    if mine != theirs:
        raise SnapshotFileError(
            f"{path} claims model {model.name} but its geometry (layers, kv heads, K head size, V head size, "
            f"dtype) {mine} differs from the model's {theirs}"
        )
    rope = model.rope
    if (rope.to_json() if rope else None) != meta.get("rope"):
        raise SnapshotFileError(
            f"{path} claims model {model.name} but its RoPE spec differs from the model's"
        )


def load_snapshot(
    path: str | Path,
    *,
    expect_fingerprint: str | None = None,
    model: HandleView | None = None,
    expect_vocab_size: int | None = None,
    verify: bool = True,
    allow_nonfinite: bool = False,
    allow_v1: bool = False,
    device: str | torch.device | None = None,
) -> KVSnapshot:
    """Read a snapshot written by :func:`save_snapshot`, validated in full.

    Raises :class:`SnapshotFileError` for a missing, non-regular, truncated, corrupt or malformed file
    (digest mismatch when ``verify``; schema, dtype, shape, position, id and finiteness checks always),
    and :class:`IncompatibleCacheError` if ``expect_fingerprint`` or ``model`` names another model.
    ``model=handle`` checks fingerprint, geometry, dtype, RoPE and vocabulary in one go.
    ``verify=False`` skips the digest and the finiteness scan (tensors are then read lazily).
    ``device``: where the K/V go (ids and positions stay on the host, as in every snapshot); by default
    the model's device with ``model=``, else the CPU, so a loaded cache can feed the model as it is.
    """
    path = Path(path)
    if device is None:
        device = model.device if model is not None else "cpu"
    if model is not None:
        expect_fingerprint = expect_fingerprint or model.fingerprint
        expect_vocab_size = expect_vocab_size or int(model.facts.vocab_size)
    if expect_vocab_size is not None and (type(expect_vocab_size) is not int or expect_vocab_size < 1):
        raise SnapshotFileError(f"expect_vocab_size must be a positive integer, got {expect_vocab_size!r}")
    # unverified, a file of another model is refused before its tensors are read
    meta, entries, tensors = _read_checked(path, allow_v1, None if verify else expect_fingerprint)
    if verify:
        if meta["version"] == 2:
            if snapshot_digest(meta, tensors) != meta["digest"]:
                raise SnapshotFileError(
                    f"{path} is corrupt or was edited: its metadata and tensors do not match the digest in its header"
                )
        elif tensors_digest(tensors) != meta["sha256"]:
            raise SnapshotFileError(f"{path} is corrupt: its tensors do not match the checksum in its header")
    _check_fingerprint(meta, expect_fingerprint, path)
    if model is not None:
        _check_model(meta, entries, model, path)
    _check_values(tensors, meta, path, expect_vocab_size, allow_nonfinite or not verify)
    n = meta["num_layers"]
    provenance = meta.get("provenance", "unknown") if meta["version"] == 2 else "unknown"
    try:
        return KVSnapshot(
            keys=tuple(tensors[f"k.{i}"].to(device) for i in range(n)),
            values=tuple(tensors[f"v.{i}"].to(device) for i in range(n)),
            token_ids=tensors["token_ids"],
            positions=tensors["positions"],
            rope=rope_from_json(meta["rope"]) if meta.get("rope") else None,
            fingerprint=meta["fingerprint"],
            model_name=meta.get("model_name") or "",
            provenance=provenance,
        )
    except KvlabError as exc:
        raise SnapshotFileError(f"{path} does not hold a valid cache: {exc}") from None


def _read_checked(
    path: Path, allow_v1: bool, expect_fingerprint: str | None
) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """A snapshot file's metadata, tensor entries and tensors (on the host), its header schema-checked and
    its tensors read back as the header declares; not yet authenticated (see :func:`load_snapshot`)."""
    fd = _open_regular(path)
    try:
        meta, entries, _ = _read_header(fd, path)
        _check_meta(meta, str(path))
        if meta["version"] == 1 and not allow_v1:
            raise SnapshotFileError(
                f"{path} is a version-1 snapshot, whose checksum does not cover its metadata; load it with "
                "allow_v1=True if you trust it and save it again (or re-create it) to get a version-2 file"
            )
        _check_tensors(meta, entries, path)
        _check_fingerprint(meta, expect_fingerprint, path)
        proc = f"/proc/self/fd/{fd}"
        try:
            tensors = load_file(proc if os.path.exists(proc) else str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own and Rust panics; the file is bad either way
            raise SnapshotFileError(f"{path} is truncated or corrupt ({exc})") from None
    finally:
        os.close(fd)
    for name, e in entries.items():  # what safetensors read is what the header checks saw
        t = tensors.get(name)
        if (
            t is None
            or list(t.shape) != e["shape"]
            or t.dtype != _TORCH_DTYPES[e["dtype"]]
            or len(tensors) != len(entries)
        ):
            raise SnapshotFileError(
                f"{path} is corrupt: tensor {name} does not read back as its header declares"
            )
    return meta, entries, tensors


def _check_fingerprint(meta: dict, expect_fingerprint: str | None, path: Path) -> None:
    if expect_fingerprint is not None and meta["fingerprint"] != expect_fingerprint:
        raise IncompatibleCacheError(
            f"{path} was made by model {meta.get('model_name') or '?'} ({meta['fingerprint'][:12]}), "
            f"not by the loaded model ({expect_fingerprint[:12]})"
        )
