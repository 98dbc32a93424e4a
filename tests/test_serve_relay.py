"""``kvlab.serve.relay``: the engine's events reach each request's queue in order, the loop is woken from
the relay's thread (never the emitting one: that wake-up is the system call the engine must not make), and
the relay's thread ends once its loop has closed."""

from __future__ import annotations

import asyncio
import threading
import time

from kvlab.serve.relay import Relay


def test_events_arrive_in_order_and_the_emitting_thread_never_wakes_the_loop():
    async def main() -> tuple[list[tuple], list[tuple], set[int]]:
        loop = asyncio.get_running_loop()
        wakers: set[int] = set()
        real = loop.call_soon_threadsafe

        def spy(*args, **kwargs):
            wakers.add(threading.get_ident())
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
        relay = Relay(loop)
        a, b = asyncio.Queue(), asyncio.Queue()
        emit_a, emit_b = relay.emitter(a), relay.emitter(b)
        producer = {}

        def produce() -> None:
            producer["id"] = threading.get_ident()
            for i in range(2000):
                (emit_a if i % 3 else emit_b)(("token", i))

        thread = threading.Thread(target=produce)
        thread.start()
        got_a = [await asyncio.wait_for(a.get(), 10) for _ in range(1333)]
        got_b = [await asyncio.wait_for(b.get(), 10) for _ in range(667)]
        thread.join()
        assert producer["id"] not in wakers and threading.get_ident() not in wakers
        return got_a, got_b, wakers

    got_a, got_b, wakers = asyncio.run(main())
    assert got_a == [("token", i) for i in range(2000) if i % 3]
    assert got_b == [("token", i) for i in range(2000) if not i % 3]
    assert len(wakers) == 1  # the relay's own thread


def test_the_relay_thread_ends_after_its_loop_has_closed():
    loop = asyncio.new_event_loop()
    before = set(threading.enumerate())
    relay = Relay(loop)
    mine = {t for t in threading.enumerate() if t.name == "kvlab-relay"} - before
    loop.close()
    relay.emitter(asyncio.Queue())(("token", 0))  # delivered to nobody: the thread sees the loop closed
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mine and not any(t.is_alive() for t in mine)
