"""Remembered digests of weight files, keyed so that a changed file can never keep an old digest.

Hashing a model's weights takes seconds, so digests are remembered in small JSON files under the
cache dir. The key is the file's identity as the OS sees it — device, inode, size, and nanosecond
mtime *and* ctime. ``cp -p`` or ``rsync -a`` can restore the size and mtime of a replaced checkpoint,
but not its ctime (set by the kernel on every write), so a replaced file always misses the memo and is
hashed again. Writers take a lock, merge with what is on disk, and replace the file atomically through
a unique temp name, so concurrent processes neither fail nor lose each other's entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def file_identity(path: Path) -> str:
    """``dev:ino:size:mtime_ns:ctime_ns`` of ``path`` (follows symlinks)."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def files_identity(paths: Iterable[Path]) -> str:
    return ";".join(f"{Path(p).name}={file_identity(p)}" for p in sorted(paths))


def _read(memo: Path) -> dict:
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def memo_get(memo: Path, key: str) -> str | None:
    value = _read(memo).get(key)
    return value if isinstance(value, str) else None


def memo_put(memo: Path, key: str, value: str) -> None:
    """Add ``key -> value`` to ``memo`` (locked read-merge-write, atomic replace). Never raises on a
    read-only or full disk: the memo is only a speed-up, so a failed write just hashes again next time."""
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        with open(memo.with_name(f".{memo.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            known = _read(memo)
            known[key] = value
            fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=f".{memo.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(known, f)
                os.replace(tmp, memo)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
