"""Freed memory back to the system, from the server's worker: glibc's ``malloc_trim`` every few seconds.

Invariant: the pages of blocks the server has freed (a dropped session's cache buffers, a finished prompt's
activations) are returned to the system within ``every`` seconds, busy or idle (an idle worker trims once,
``every`` seconds after its last work); no allocation pays for it, and a burst of short requests is not
trimmed between each.

Why: glibc raises its mmap threshold each time a mapped block is freed, so once sessions have been dropped
the next sessions' cache buffers (0.8 MB per layer and K/V for SmolLM2 at window 1024) come from the heap,
which keeps the pages of every block freed there: over 1,000 sessions resident memory climbed from 1.4 GB
to 3.2 GB, still growing (``benchmarks/results/serve_sessions_smollm2.md``). ``malloc_trim(0)`` hands those
free pages back (a few milliseconds on the bundled model's heap). The earlier fix, the mmap threshold fixed
at 128 KiB, gave every block that size its own mapping, faulted in and zeroed at each allocation: a
prompt's activations are such blocks, and a long served turn's first token came 1.83x later than on 6050923
(median of turns 2-4, 4 rounds alternated, ``benchmarks/results/serve.md``; 1.17x with the trim, the rest the
prompt fed in pieces: ``EngineSettings.prefill_alone``). Not glibc: nothing to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):  # another C library: nothing to trim
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    return None


class Trimmer:
    """``trim()`` after a piece of work: hands the free pages back at most once per ``every`` seconds;
    ``idle()`` when the worker has nothing to do: once, if work ran since the last trim. ``wait`` is how long
    the idle worker should sleep before calling ``idle()`` (None: nothing to hand back, sleep until woken)."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.trims = 0
        self._libc = _libc()
        self._last = time.monotonic()
        self._dirty = False  # work ran since the last trim

    @property
    def wait(self) -> float | None:
        return self.every if self._dirty and self._libc is not None else None

    def trim(self) -> None:
        self._dirty = True
        if time.monotonic() - self._last >= self.every:
            self._now()

    def idle(self) -> None:
        if self._dirty:
            self._now()

    def _now(self) -> None:
        if self._libc is not None:
            self._libc.malloc_trim(0)
            self.trims += 1
        self._last, self._dirty = time.monotonic(), False
