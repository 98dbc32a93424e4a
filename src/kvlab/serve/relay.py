"""The engine's events to the event loop, woken from a thread of the relay's own.

Invariant: every event a request's ``emit`` is given reaches that request's queue on the loop, in the
order it was given (one FIFO, one thread delivering it).

Why a thread: ``loop.call_soon_threadsafe`` wakes the loop by writing to its self-pipe, a system call,
and a system call lets go of the GIL. Made from the engine's thread after each token, the loop woke, took
the GIL and turned the token into a chunk of the stream while the engine waited for it back (py-spy, one
conversation decoding through ``--capture compile``, 2026-12-01: 1.7% of the engine's samples were in that
write; the served rate did not move measurably, ``benchmarks/results/serve_decode.md``).
The engine now appends to a queue, which lets go of nothing; the relay wakes the loop once the GIL is
free, which is while the engine's next step runs its kernels (they release it), so the chunk is made on
the other core. A token reaches its stream a step's Python later.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

Item = tuple[asyncio.Queue, tuple]


class Relay:
    """Delivers events to queues on ``loop``. Its thread ends when the loop has closed (at the first
    event after), and is a daemon (a stopped server leaves it waiting, idle)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvlab-relay", daemon=True).start()

    def emitter(self, to: asyncio.Queue) -> Callable[[tuple], None]:
        """An ``emit`` for one request (any thread): its events onto ``to``."""
        put = self._items.put
        return lambda event: put((to, event))

    def _run(self) -> None:
        while True:
            batch = [self._items.get()]
            while not self._items.empty():  # what came meanwhile: one wake-up for all of it
                batch.append(self._items.get_nowait())
            try:
                self.loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop has closed: nobody reads these queues any more
                return


def _deliver(batch: list[Item]) -> None:
    for to, event in batch:
        to.put_nowait(event)
