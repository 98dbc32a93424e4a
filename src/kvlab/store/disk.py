"""The disk tier: one safetensors file per block, atomic writes, checked reads, a byte cap.

Reads: :meth:`DiskTier.read_into` (what :class:`~kvlab.store.store.KVStore` lookups use) reads a
block's tensor bytes straight into the caller's output with ``preadv`` and checks its XXH3-64
checksum on those bytes while they are still in the CPU cache (one copy in all); :meth:`DiskTier.get`
returns a :class:`Block` whose tensors view an ``mmap`` of the file or a reusable read buffer.

Layout: ``<root>/kvlab-store.json`` (marks the folder as a store), ``<root>/blocks/<parent>/<hash>.kvb``
(grouping by parent makes "children of a parent" one directory listing), ``<root>/quarantine/``
(blocks that failed their checksum). Invariants: a ``.kvb`` file is only ever created by an atomic
rename of a complete, fsync'ed temporary file, so readers in any process see a whole block or none;
every read checks the block's checksum and that it is the block asked for; a file's mtime is its last
use, and eviction removes the least recently used files until the folder is under its cap.

Every file in the folder is treated as hostile: a block file is opened with ``O_NOFOLLOW`` (a symbolic
link is refused: kvlab never makes one, and ``/dev/zero`` behind one never ends) and ``O_NONBLOCK`` (a
FIFO cannot block the open), then ``fstat`` must say it is a regular file (no FIFO, device, socket or
folder); its header is read with a bounded size and JSON depth, and the tensor bytes it declares must be
exactly the rest of the file before any of them are read. Anything else is a corrupt block: reported,
quarantined and a miss. A file that cannot be read (permissions, I/O errors) is a counted miss, logged
at most every 30 s, never an exception out of a lookup.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from kvlab.cache.io import atomic_write_bytes
from kvlab.errors import BadInputError
from kvlab.store.block import (
    MAX_HEADER_BYTES,
    Block,
    BlockHeader,
    decode_block,
    encode_block,
    parse_block_header,
)
from kvlab.store.errors import CorruptBlockError, StoreError, StoreWriteError
from kvlab.store.keys import block_problem
from kvlab.store.tier import RateLimitedLog, TierCounters

log = logging.getLogger("kvlab.store")

MARKER = "kvlab-store.json"
SUFFIX = ".kvb"
STALE_TEMP_SECONDS = 60.0
#: read_into leaves a file's mtime alone if it was used this recently (saves a metadata write)
TOUCH_SECONDS = 1.0
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_HEAD_BYTES = 16 * 1024  # first read of a block file: the whole header of a block of up to ~1k tokens
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_GROUP_BYTES = 512 * 1024  # read_into reads and hashes this much at a time (fits in L2)
DECLINED = "declined"  # read_into: the caller's ``dest`` refused the block (nothing read, nothing counted)
# How every block file is opened: never through a symbolic link, never blocking (a FIFO), never inherited.
_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK, errno.ENXIO}  # O_NOFOLLOW on a link (Linux, BSD); a socket


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (for refusals)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class NotABlockFile(CorruptBlockError):
    """Something that can never be a block sits where a block file belongs (a folder, FIFO, device, link)."""


@contextlib.contextmanager
def open_block_file(path: str | Path) -> Iterator[tuple[int, os.stat_result]]:
    """An fd of the block file at ``path`` and its ``fstat`` (closed on leaving), opened so that no file can
    hang or redirect it.

    Raises FileNotFoundError (nothing there), :class:`NotABlockFile` (a symbolic link, folder, FIFO,
    device or socket: refused without reading a byte) or OSError (a file that cannot be read).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS:
            try:
                kind = file_kind(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise NotABlockFile(f"{kind}, not a block file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotABlockFile(f"{file_kind(st.st_mode)}, not a block file")
        yield fd, st
    finally:
        os.close(fd)


def read_header_at(fd: int, size: int) -> BlockHeader:
    """The checked header of the open block file ``fd`` of ``size`` bytes (only its header is read).

    Its declared tensor bytes must be exactly the rest of the file, so nothing beyond what the header
    says is ever read after it.
    """
    head = os.pread(fd, _HEAD_BYTES, 0)
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if n > MAX_HEADER_BYTES:
        raise CorruptBlockError(f"its header claims {n:,} bytes, over the {MAX_HEADER_BYTES:,} a block has")
    need = 8 + n
    if len(head) < need <= size:
        head += os.pread(fd, need - len(head), len(head))
    return parse_block_header(head, size)


def read_exactly(fd: int, into: memoryview, offset: int = 0) -> bool:
    """Fill ``into`` from ``fd`` at ``offset``; False if the file ends first."""
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if not n:
            return False
        got += n
    return True


def read_file(
    path: str | Path, max_bytes: int, check: Callable[[int, int], object] | None = None, touch: bool = False
) -> bytearray:
    """The whole file at ``path``, opened by :func:`open_block_file`; ``check(fd, size)`` runs before a byte
    of it is read, and ``touch`` sets its mtime (its last use). Raises FileNotFoundError, OSError or
    CorruptBlockError (not a regular file, over ``max_bytes``, refused by ``check``, shrank while read)."""
    with open_block_file(path) as (fd, st):
        if st.st_size > max_bytes:
            raise CorruptBlockError(f"{st.st_size:,} bytes, over this tier's cap of {max_bytes:,}; not read")
        if check is not None:
            check(fd, st.st_size)
        data = bytearray(st.st_size)
        if not read_exactly(fd, memoryview(data)):
            raise CorruptBlockError("the file shrank while it was read")
        if touch:
            with contextlib.suppress(OSError):
                os.utime(fd)
        return data


def evict_lru(
    files: Iterable[tuple[float, int, Path]], target_bytes: int, failed: Callable[[Path, OSError], object]
) -> tuple[int, int]:
    """Delete the least recently used of ``files`` ``(mtime, size, path)`` until the rest hold at most
    ``target_bytes``: ``(files deleted, bytes left)``. A file another process deleted first counts as gone;
    one that cannot be deleted goes to ``failed`` and stays."""
    ordered = sorted(files, key=lambda f: f[0])
    total = sum(size for _, size, _ in ordered)
    removed = 0
    for _, size, path in ordered:
        if total <= target_bytes:
            break
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed(path, exc)
            continue
        total -= size
    return removed, total


class ReadBuffer:
    """A reusable read buffer: blocks read into it are views, valid until the next read (copy them out)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def view(self, size: int) -> memoryview:
        if len(self._data) < size:
            self._data = bytearray(size)  # a new buffer; views of the old one stay valid
        return memoryview(self._data)[:size]


@dataclass(frozen=True)
class DiskEntry:
    parent: str
    hash: str
    path: Path
    nbytes: int
    mtime: float
    kind: str = "a regular file"  # what lstat says it is; only regular files are ever read

    @property
    def regular(self) -> bool:
        return self.kind == "a regular file"


class DiskTier:
    """Blocks as files under ``root``; ``max_bytes`` caps the sum of block file sizes."""

    name = "disk"
    persistent = True

    def __init__(
        self, root: str | Path, max_bytes: int = 20 * 2**30, *, create: bool = True, low_water: float = 0.9
    ):
        if max_bytes < 1:
            raise BadInputError(f"the disk tier needs a positive byte cap, got {max_bytes}")
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes)
        self.low_water = low_water
        self.counters = TierCounters()
        self._log = RateLimitedLog(log)
        self._open(create)
        self._approx_bytes: int | None = None

    def _open(self, create: bool) -> None:
        root, marker = self.root, self.root / MARKER
        if root.exists() and not root.is_dir():
            raise StoreError(f"store path {root} is a file, not a folder; give a folder for --store")
        if marker.is_file():
            return
        if not root.exists() and not create:
            raise StoreError(f"no kvlab store at {root}; put something in it first or check --store")
        if root.exists() and any(root.iterdir()):
            raise StoreError(
                f"{root} is a non-empty folder without {MARKER}, so it is not a kvlab store; "
                "pick a new or empty folder"
            )
        try:
            root.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(marker, json.dumps({"format": "kvlab.store", "version": 1}).encode())
        except OSError as exc:
            raise StoreError(f"cannot create a store at {root}: {exc.strerror or exc}") from None

    def _path(self, parent: str, block_hash: str) -> Path:
        return self.root / "blocks" / parent / f"{block_hash}{SUFFIX}"

    # -- reads -------------------------------------------------------------------------------------
    def contains(self, parent: str, block_hash: str) -> bool:
        """Whether a block file is there (not read). Something else at its name (a folder, a FIFO, a link)
        is reported and quarantined, so the block can be written again; an unreadable folder is a no."""
        path = self._path(parent, block_hash)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._unreadable(path, exc)
            return False
        if stat.S_ISREG(mode):
            return True
        self._quarantine(path, f"{file_kind(mode)}, not a block file")
        return False

    def _failed(self, path: Path, exc: CorruptBlockError | OSError, quarantine: bool = True) -> str | None:
        """A block read that failed: why, for a corrupt block (quarantined with ``quarantine``); None for
        a missing file, or an I/O error (reported)."""
        if isinstance(exc, FileNotFoundError):
            return None
        if isinstance(exc, CorruptBlockError):
            if quarantine:
                self._quarantine(path, str(exc))
            return str(exc)
        self._unreadable(path, exc)
        return None

    def _unreadable(self, path: Path, exc: OSError | str) -> None:
        self.counters.errors += 1
        why = exc if isinstance(exc, str) else (exc.strerror or str(exc))
        self._log.warn("unreadable", f"kvlab store: cannot read {path} ({why}); treated as a miss")

    def _within_cap(self, size: int) -> None:
        """An OSError (the file is reported and left in place, not quarantined) for a file over the cap."""
        if size > self.max_bytes:
            raise OSError(
                errno.EFBIG, f"{size:,} bytes, over this tier's cap of {self.max_bytes:,}; not read"
            )

    def get(self, parent: str, block_hash: str, scratch: ReadBuffer | None = None) -> Block | None:
        """The block or None (missing or corrupt).

        Without ``scratch`` the tensors are views of a read-only mmap of the file (valid as long as they
        live). With ``scratch`` the file is read into that reusable buffer (grown as needed) and the
        tensors are views of it, valid only until the next read into it: copy them out first.
        """
        path, started = self._path(parent, block_hash), time.perf_counter()
        data: Any = None
        try:
            with open_block_file(path) as (fd, st):
                self._within_cap(st.st_size)
                if st.st_size == 0:
                    raise CorruptBlockError("empty block file")
                read_header_at(fd, st.st_size)  # the declared size is the file's, before the tensors are read
                if scratch is None:
                    # MAP_POPULATE maps every page up front: one kernel call instead of a fault per 4 KiB page.
                    data = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
                else:
                    data = scratch.view(st.st_size)
                    if not read_exactly(fd, data):
                        raise CorruptBlockError("the file shrank while it was read")
            block = decode_block(data, expect_hash=block_hash)
            if block.parent != parent:
                raise CorruptBlockError(f"block {block_hash[:12]} is filed under the wrong parent")
        except (CorruptBlockError, OSError) as exc:
            self._failed(path, exc)
            self.counters.misses += 1
            return None
        with contextlib.suppress(OSError):  # another process may have evicted it meanwhile
            os.utime(path)  # the file's mtime is its last use (LRU order for eviction)
        self.counters.hit(block.nbytes, started)
        return block

    def prefetch(self, parent: str, block_hash: str) -> None:
        """Ask the kernel to start reading the block's file in the background (a hint; errors ignored).

        Skipped when the file's last byte is already in the page cache (probed with a non-blocking
        1-byte read): ``WILLNEED`` on a cached file only costs time walking its pages.
        """
        if not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError, CorruptBlockError):  # the read that follows reports them
            with open_block_file(self._path(parent, block_hash)) as (fd, st):
                if _NOWAIT and st.st_size:
                    with contextlib.suppress(OSError):  # not cached (EAGAIN) or no RWF_NOWAIT here
                        if os.preadv(fd, [bytearray(1)], st.st_size - 1, _NOWAIT) == 1:
                            return  # cached (blocks are written and read whole)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def read_into(
        self,
        parent: str,
        block_hash: str,
        dest: Callable[[BlockHeader], tuple[torch.Tensor, torch.Tensor] | None],
    ) -> BlockHeader | str | None:
        """Read a block's tensors straight into caller-owned memory: one copy, from the page cache to ``dest``.

        Reads and checks the header, then calls ``dest(header)``, which returns the ``(keys, values)``
        tensors to fill (``[layers, kv_heads, n, head_dim]``, may be slices of a larger tensor along
        the token axis), or None to decline; then ``preadv`` reads the tensor bytes into them and the
        checksum is computed over those bytes where they landed (still in the CPU cache).

        Returns the header on success; ``DECLINED`` if ``dest`` declined or the file's layout needs
        the general path (:meth:`get`); None for a missing or corrupt block (corrupt: quarantined).
        On None the destination may hold garbage: the caller must not use it.
        """
        path, started = self._path(parent, block_hash), time.perf_counter()
        try:
            with open_block_file(path) as (fd, st):
                self._within_cap(st.st_size)
                hdr = read_header_at(fd, st.st_size)
                if hdr.hash != block_hash:
                    raise CorruptBlockError(f"block file holds {hdr.hash[:12]}, expected {block_hash[:12]}")
                if hdr.parent != parent:
                    raise CorruptBlockError(f"block {block_hash[:12]} is filed under the wrong parent")
                target = dest(hdr)
                layout = None if target is None else _chunks(hdr, *target)
                if layout is None:
                    return DECLINED
                hasher = hdr.hasher()
                if not _read_and_hash(fd, *layout, hdr.data_offset, hasher):
                    raise CorruptBlockError("the file is shorter than its header says")
                hdr.check(hasher)
                if time.time() - st.st_mtime >= TOUCH_SECONDS:  # mtime = last use (LRU order for eviction)
                    with contextlib.suppress(OSError):
                        os.utime(fd)
        except (CorruptBlockError, OSError) as exc:  # mid-read: the destination holds garbage (None drops it)
            self._failed(path, exc)
            self.counters.misses += 1
            return None
        self.counters.hit(hdr.data_bytes, started)
        return hdr

    def children(self, parent: str) -> dict[str, tuple[int, ...]]:
        folder = self.root / "blocks" / parent
        out: dict[str, tuple[int, ...]] = {}
        for name in (e.name for e in self._listing(folder)):
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            header = self.read_header(folder / name, quarantine=True)
            if isinstance(header, BlockHeader):
                out[name[: -len(SUFFIX)]] = header.token_ids
        return out

    def read_header(self, path: Path, *, quarantine: bool = False) -> BlockHeader | str | None:
        """The checked header of the block file at ``path`` (tensors not read): the header, why it is not
        a block (quarantined with ``quarantine``), or None if nothing is there (or it is unreadable)."""
        try:
            with open_block_file(path) as (fd, st):
                return read_header_at(fd, st.st_size)
        except (CorruptBlockError, OSError) as exc:
            return self._failed(path, exc, quarantine)

    def find(self, block_hash: str) -> Block | None:
        for entry in self.entries():
            if entry.hash == block_hash:
                return self.get(entry.parent, block_hash)
        return None

    def entries(self) -> Iterator[DiskEntry]:
        """Everything named like a block file (temporary files of unfinished writes are skipped), as ``lstat``
        sees it: an entry that is not a regular file (``entry.regular`` False) is never read, never
        counted in the tier's size, and is reported by :meth:`verify`. Folders that cannot be listed are
        skipped (and logged)."""
        for parent_dir in self._listing(self.root / "blocks"):
            try:
                is_dir = parent_dir.is_dir(follow_symlinks=False)
            except OSError as exc:
                self._unreadable(Path(parent_dir.path), exc)
                continue
            for e in self._listing(Path(parent_dir.path)) if is_dir else []:
                if e.name.endswith(SUFFIX) and not e.name.startswith("."):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        self._unreadable(Path(e.path), exc)
                        continue
                    yield DiskEntry(
                        parent_dir.name,
                        e.name[: -len(SUFFIX)],
                        Path(e.path),
                        st.st_size if stat.S_ISREG(st.st_mode) else 0,
                        st.st_mtime,
                        file_kind(st.st_mode),
                    )

    def _listing(self, folder: Path) -> list[os.DirEntry]:
        """What ``folder`` holds: nothing when it is missing, or unreadable (then reported)."""
        try:
            return list(os.scandir(folder))
        except FileNotFoundError:
            return []
        except OSError as exc:  # a file or an unreadable folder where a folder belongs
            self._unreadable(folder, exc)
            return []

    def temp_files(self) -> list[Path]:
        blocks = self.root / "blocks"
        try:
            return sorted(blocks.glob("*/.*.tmp")) if blocks.is_dir() else []
        except OSError:
            return []

    # -- writes ------------------------------------------------------------------------------------
    def put(self, block: Block) -> list[Block]:
        """Write the block (atomically) unless present; evicts LRU files beyond the cap."""
        path = self._path(block.parent, block.hash)
        if self.contains(block.parent, block.hash):  # (something else at its name is moved away first)
            return []
        data = encode_block(block)
        if len(data) > self.max_bytes:
            self.counters.rejected += 1
            return []
        try:
            atomic_write_bytes(path, data)
        except OSError as exc:
            self.counters.errors += 1
            raise StoreWriteError(
                f"could not write block {block.hash[:12]} to {self.root}: {exc.strerror or exc}; "
                "free disk space or lower the disk tier's cap (blocks already stored are intact)"
            ) from None
        self.counters.puts += 1
        try:
            if self._approx_bytes is None:
                self._approx_bytes = self.usage()[1]
            else:
                self._approx_bytes += len(data)
            if self._approx_bytes > self.max_bytes:
                self.evict_to(int(self.max_bytes * self.low_water))
        except OSError as exc:  # the block is written; eviction tries again on the next put
            self._unreadable(self.root, exc)
            self._approx_bytes = None
        return []

    def evict_to(self, target_bytes: int) -> int:
        """Delete least recently used block files until the tier holds at most ``target_bytes``."""
        files = ((e.mtime, e.nbytes, e.path) for e in self.entries() if e.regular)
        removed, self._approx_bytes = evict_lru(files, target_bytes, self._unreadable)
        self.counters.evictions += removed
        return removed

    def delete(self, block_hash: str) -> bool:
        for e in self.entries():
            if e.hash == block_hash:
                if not e.regular:
                    self._quarantine(e.path, f"{e.kind}, not a block file")
                    return True
                try:
                    e.path.unlink(missing_ok=True)
                except OSError as exc:
                    raise StoreError(f"cannot delete {e.path}: {exc.strerror or exc}") from None
                return True
        return False

    def discard(self, parent: str, block_hash: str, reason: str) -> None:
        """Quarantine a block that is not what its name says (reported)."""
        self._quarantine(self._path(parent, block_hash), reason)

    def _quarantine(self, path: Path, reason: str) -> None:
        self.counters.corrupt += 1
        log.warning(
            "kvlab store: %s is corrupt (%s); moved to quarantine and treated as a miss", path, reason
        )
        qdir = self.root / "quarantine"
        try:
            qdir.mkdir(exist_ok=True)
            os.replace(path, qdir / f"{path.stem}.{int(time.time() * 1000)}{SUFFIX}")
        except OSError:
            pass

    # -- maintenance -------------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        sizes = [e.nbytes for e in self.entries() if e.regular]
        return len(sizes), sum(sizes)

    def verify(self, *, repair: bool = False) -> dict:
        """Read and checksum every block; with ``repair``, quarantine corrupt ones."""
        ok, corrupt = 0, []
        for e in list(self.entries()):
            try:
                # refused before a byte of its tensors is read if its header is not a block's
                block = decode_block(read_file(e.path, self.max_bytes, read_header_at), expect_hash=e.hash)
                if block.parent != e.parent:
                    raise CorruptBlockError("filed under the wrong parent")
                problem = block_problem(block)
                if problem:
                    raise CorruptBlockError(f"block {e.hash[:16]}: {problem}")
                ok += 1
            except FileNotFoundError:
                continue
            except CorruptBlockError as exc:
                corrupt.append({"path": str(e.path), "reason": str(exc)})
                if repair:
                    self._quarantine(e.path, str(exc))
            except OSError as exc:  # left in place: it may be readable another time
                corrupt.append({"path": str(e.path), "reason": f"cannot be read: {exc.strerror or exc}"})
        return {"ok": ok, "corrupt": corrupt, "temp_files": [str(p) for p in self.temp_files()]}

    def gc(self, *, stale_seconds: float = STALE_TEMP_SECONDS) -> dict:
        """Remove leftovers of killed writes (older than ``stale_seconds``), evict to the cap, drop empty folders."""
        now = time.time()
        temps = 0
        for p in self.temp_files():
            try:
                st = p.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # kvlab's temp files are regular files; anything else is not ours to remove
                if now - st.st_mtime >= stale_seconds:
                    p.unlink()
                    temps += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._unreadable(p, exc)
        evicted = self.evict_to(self.max_bytes)
        blocks = self.root / "blocks"
        with contextlib.suppress(OSError):
            for d in list(blocks.iterdir()) if blocks.is_dir() else []:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only succeeds when empty
        return {"temp_files_removed": temps, "evicted": evicted}


def _chunks(
    hdr: BlockHeader, keys: torch.Tensor, values: torch.Tensor
) -> tuple[list[memoryview], int] | None:
    """Writable byte views of ``keys`` and ``values``, one per (layer, head), in the file's byte order.

    Returns the views and their common length, or None when the block cannot be read straight into
    them (shape, dtype or layout differ, or the file's tensor bytes do not exactly follow one
    another): the caller then takes the general path.
    """
    out: list[tuple[int, list[memoryview]]] = []
    row = 0
    for spec, t in ((hdr.k, keys), (hdr.v, values)):
        if (
            tuple(t.shape) != spec.shape
            or t.dtype != spec.dtype
            or t.device.type != "cpu"
            or t.stride(3) != 1
            or (t.shape[2] > 1 and t.stride(2) != t.shape[3])
        ):
            return None
        # One byte view of the whole storage, sliced per (layer, head): the rows of one (layer, head)
        # are contiguous in a [layers, heads, T, head_dim] tensor sliced along T.
        size = t.element_size()
        row = t.shape[2] * t.shape[3] * size
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        base = memoryview(cast(Any, flat.numpy()))  # numpy's stubs: a Buffer only on Python >= 3.12
        off = t.storage_offset() * size
        starts = _row_starts(t.shape[0], t.shape[1], t.stride(0) * size, t.stride(1) * size)
        out.append((spec.begin, [base[off + x : off + x + row] for x in starts]))
    out.sort(key=lambda x: x[0])
    at = 0
    for begin, views in out:
        if begin != at:
            return None
        at += len(views) * row
    if at != hdr.data_bytes or not row:
        return None
    return [v for _, views in out for v in views], row


@functools.lru_cache(maxsize=64)
def _row_starts(layers: int, heads: int, layer_stride: int, head_stride: int) -> tuple[int, ...]:
    """Byte offsets of the (layer, head) rows of a [layers, heads, T, head_dim] tensor, in file order."""
    return tuple(i * layer_stride + j * head_stride for i in range(layers) for j in range(heads))


def _read_and_hash(fd: int, chunks: list[memoryview], row: int, offset: int, hasher: Any) -> bool:
    """Fill ``chunks`` (each ``row`` bytes) from ``fd`` from ``offset`` on, hashing each group as it lands.

    Groups of about 512 KiB, so each is hashed while it is still in the CPU's L2 cache. False if the
    file ends first.
    """
    per = max(1, min(_IOV_MAX, _GROUP_BYTES // row))
    update = hasher.update
    for i in range(0, len(chunks), per):
        group = chunks[i : i + per]
        want = len(group) * row
        got = os.preadv(fd, group, offset)
        if got != want and not _preadv_rest(fd, group, offset, got):
            return False
        for c in group:
            update(c)
        offset += want
    return True


def _preadv_rest(fd: int, chunks: list[memoryview], offset: int, got: int) -> bool:
    """Finish a short ``preadv`` that filled ``got`` bytes of ``chunks``; False if the file ends first."""
    pending = list(chunks)
    while True:
        if got <= 0:
            return False
        offset += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if not pending:
            return True
        if got:  # the read ended inside a chunk: continue with its remainder
            pending[0] = pending[0][got:]
        got = os.preadv(fd, pending, offset)
