"""Small C kernels, compiled on first use with the system's C compiler and loaded with ctypes.

torch has no operator that attends to packed 4-bit codes without expanding them to full precision
first, and doing that expansion with tensor ops costs more than the attention itself (issue 15). The
kernels here are plain C (no torch headers, so a build takes well under a second), compiled once per
source version and machine into kvlab's cache folder (``$KVLAB_CACHE_DIR/kernels``), and written
there atomically (a half-written library is never loaded). Without a working compiler,
:func:`load` returns None and callers keep their tensor-op path: slower, same results. A C++ kernel
(``<name>.cpp``) is a torch operator: built against the running torch's headers and libraries (about ten
seconds on 2 cores), it registers itself with torch's dispatcher when loaded.

Loading a shared library runs its code, and the library's name is predictable, so a file planted at
that name must never be loaded (issues 27 and 48). The folder is private (created 0700; one owned by
another user, or open to others, is refused), and so is every folder above it: each must belong to
this user or root and be writable by nobody else unless it is sticky (like ``/tmp``), or someone could
rename the folder away and put their own in its place. A library is loaded only if it is a regular file
we own, writable by nobody else, whose SHA-256 equals the one recorded when this user built it; on
Linux the library is loaded from the very file descriptor whose bytes were hashed
(``/proc/self/fd/N``), so nothing can swap the file between the check and the load. Anything else
there is discarded and rebuilt.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from kvlab.paths import cache_dir

HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]
CXX_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c++20", "-w"]
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_ERRORS: dict[str, str] = {}
_HELD: list[int] = []  # descriptors of the libraries loaded by /proc/self/fd/N, open for the process's life


def _machine_key() -> str:
    """CPU features (``-march=native`` builds for this CPU): a library built elsewhere is not reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiler(cxx: bool = False) -> str | None:
    """The system's C (or C++) compiler (None: none found)."""
    if cxx:
        return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _command(source: Path, out: str) -> list[str]:
    """How ``source`` builds: plain C, or C++ against the running torch (its headers, ABI and libraries)."""
    cxx = source.suffix == ".cpp"
    cc = compiler(cxx)
    if cc is None:
        raise RuntimeError(f"no {'C++' if cxx else 'C'} compiler on PATH")
    if not cxx:
        return [cc, *FLAGS, str(source), "-o", out]
    import torch
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [x for p in cpp_extension.library_paths() for x in (f"-L{p}", f"-Wl,-rpath,{p}")]
    return [cc, *CXX_FLAGS, abi, *includes, str(source), "-o", out, *libs, "-lc10", "-ltorch_cpu"]


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel ``name`` (``kvlab/kernels/<name>.c`` or ``.cpp``), building it if needed; None if no
    compiler can build it here (the reason is in :func:`why_not`)."""
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
        lib = None
        try:
            lib = _load_verified(_build(name))
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            _ERRORS[name] = str(e)
        _LOADED[name] = lib
        return lib


def why_not(name: str) -> str | None:
    """Why :func:`load` returned None for ``name`` (None if it loaded or was never asked for)."""
    return _ERRORS.get(name)


def _build(name: str) -> Path:
    source = next((p for p in (HERE / f"{name}.c", HERE / f"{name}.cpp") if p.exists()), HERE / f"{name}.c")
    command = _command(source, "OUT")
    versions = " ".join(command) + (_torch_version() if source.suffix == ".cpp" else "")
    digest = hashlib.sha256(
        b"\0".join([source.read_bytes(), versions.encode(), _machine_key().encode()])
    ).hexdigest()[:16]
    out_dir = _private_dir(cache_dir() / "kernels")
    target = out_dir / f"{name}-{digest}.so"
    record = out_dir / f"{name}-{digest}.sha256"
    if _trusted(target, record):
        return target
    for stale in (target, record):  # planted, corrupt or unrecorded: never loaded, replaced by our build
        if os.path.lexists(stale):
            os.unlink(stale)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(_command(source, tmp), capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{command[0]} failed on {source.name}: {proc.stderr.strip()[:2000]}")
        os.chmod(tmp, 0o700)
        _write_atomic(record, _sha256(Path(tmp)).encode(), out_dir)
        os.replace(tmp, target)  # atomic: another process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not _trusted(target, record):  # another process replaced it between our writes: build again later
        raise RuntimeError(f"{target} changed while it was being built; not loading it")
    return target


def _torch_version() -> str:
    import torch

    return torch.__version__


def _private_dir(path: Path) -> Path:
    """``path`` as a folder only this user can write (created 0700); refused if another user owns it or
    others may write to it (someone else could then plant a library there)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_ancestors(path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a folder (a link?); not building kernels there")
    if st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} belongs to another user; not loading kernels from it")
    if st.st_mode & 0o022:
        raise RuntimeError(
            f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            "not loading kernels from it (chmod 700 it)"
        )
    return path


def _check_ancestors(path: Path) -> None:
    """Refuse ``path`` if a folder above it could be renamed or replaced by someone else: every ancestor
    (symbolic links resolved) must belong to this user or root, and be writable by nobody else unless
    its sticky bit is set (then others cannot rename what they do not own)."""
    me = os.geteuid()
    for folder in path.resolve().parents:
        st = os.stat(folder)
        if st.st_uid not in (me, 0):
            raise RuntimeError(
                f"{folder} (above {path}) belongs to another user; not loading kernels under it"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise RuntimeError(
                f"{folder} (above {path}) is writable by others and not sticky (mode "
                f"{stat.S_IMODE(st.st_mode):o}); not loading kernels under it"
            )


def _load_verified(target: Path) -> ctypes.CDLL:
    """Load ``target`` after checking its bytes against its record once more, from one open descriptor:
    on Linux the loader maps ``/proc/self/fd/N``, the very file that was hashed. The descriptor of a
    library loaded so stays open (:data:`_HELD`): the loader knows a library by the name it was opened
    under and hands back the one already loaded under a name asked for again, so a second kernel opened
    at a number the first had used and closed came back as the first (issue 46's note of 2026-12-02)."""
    record = target.with_suffix(".sha256")
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW)
    held = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(f"{target} is not a private regular file of ours; not loading it")
        h = hashlib.sha256()
        for block in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(block)
        if not hmac.compare_digest(record.read_bytes(), h.hexdigest().encode()):
            raise RuntimeError(f"{target} does not match its record; not loading it")
        by_fd = Path(f"/proc/self/fd/{fd}")
        if not by_fd.exists():
            return ctypes.CDLL(str(target))
        lib = ctypes.CDLL(str(by_fd))
        _HELD.append(fd)
        held = True
        return lib
    finally:
        if not held:
            os.close(fd)


def _trusted(target: Path, record: Path) -> bool:
    """Whether ``target`` is our own library, unchanged since we built it."""
    try:
        st = os.lstat(target)
        rec = os.lstat(record)
    except FileNotFoundError:
        return False
    for s in (st, rec):
        if not stat.S_ISREG(s.st_mode) or s.st_uid != os.geteuid() or s.st_mode & 0o022:
            return False
    if rec.st_size != 64:
        return False
    return hmac.compare_digest(record.read_bytes(), _sha256(target).encode())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes, folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rec-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
