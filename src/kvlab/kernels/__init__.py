"""Small C kernels, compiled on first use with the system's C compiler and loaded with ctypes.

torch has no operator that attends to packed 4-bit codes without expanding them to full precision
first, and doing that expansion with tensor ops costs more than the attention itself (issue 15). The
kernels here are plain C (no torch headers, so a build takes well under a second), compiled once per
source version and machine into kvlab's cache folder (``$KVLAB_CACHE_DIR/kernels``), and written
there atomically (a half-written library is never loaded). Without a working compiler,
:func:`load` returns None and callers keep their tensor-op path: slower, same results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kvlab.paths import cache_dir

HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_ERRORS: dict[str, str] = {}


def _machine_key() -> str:
    """CPU features (``-march=native`` builds for this CPU): a library built elsewhere is not reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel ``name`` (``kvlab/kernels/<name>.c``), building it if needed; None if no
    compiler can build it here (the reason is in :func:`why_not`)."""
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
        lib = None
        try:
            lib = ctypes.CDLL(str(_build(name)))
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            _ERRORS[name] = str(e)
        _LOADED[name] = lib
        return lib


def why_not(name: str) -> str | None:
    """Why :func:`load` returned None for ``name`` (None if it loaded or was never asked for)."""
    return _ERRORS.get(name)


def _build(name: str) -> Path:
    source = HERE / f"{name}.c"
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    digest = hashlib.sha256(
        b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), cc.encode(), _machine_key().encode()])
    ).hexdigest()[:16]
    out_dir = cache_dir() / "kernels"
    target = out_dir / f"{name}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[:2000]}")
        os.replace(tmp, target)  # atomic: another process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
