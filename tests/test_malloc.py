"""``kvlab serve`` hands freed memory back to the system (``kvlab.serve.heap``).

By default glibc raises its mmap threshold each time a mapped block is freed, so a dropped session's cache
buffers make the next session's buffers come from the heap, which keeps the pages of every block freed
there; on the bundled model resident memory climbed from 1.4 GB to 3.2 GB over 1,000 sessions
(``benchmarks/results/serve_sessions_smollm2.md`` has the run). The engine's worker calls ``malloc_trim``
at most every few seconds while it works, and once when it has been idle that long. Checked here in fresh processes (the allocator's state is
the process's): blocks freed into the heap stay resident until a trim hands them back, and no allocation is
given a mapping of its own (the earlier fix did that, and every prefill paid for it).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvlab.loop import GREEDY
from kvlab.serve.engine import Engine, EngineSettings, Request
from kvlab.serve.heap import Trimmer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")

PROBE = """
import ctypes, torch
from kvlab.serve.heap import Trimmer
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = Info
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
trimmer = Trimmer()
del trimmer  # making one changes nothing in the allocator
first = torch.ones(2**18)  # 1 MiB: above the default threshold, so mapped
del first                  # freeing it raises the threshold: the next blocks come from the heap
mapped = libc.mallinfo2().hblks
blocks = [torch.ones(2**18) for _ in range(200)]  # 200 MiB written in the heap
mapped = libc.mallinfo2().hblks - mapped
keep = torch.ones(16)  # a small live block above them: the heap's top cannot shrink past it
del blocks
before = resident_mb()
Trimmer(every=0.0).trim()
print(mapped, round(before), round(resident_mb()))
"""


def _probe() -> tuple[int, float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    mapped, before, after = out.stdout.split()[-3:]
    return int(mapped), float(before), float(after)


@pytest.mark.process
def test_a_trim_hands_freed_heap_pages_back_and_no_block_is_given_a_mapping():
    mapped, before, after = _probe()
    assert mapped == 0  # the 200 blocks came from the heap: no allocation pays for a mapping of its own
    assert before - after > 150, (before, after)  # the freed 200 MiB left resident memory at the trim


def test_trims_are_at_most_one_per_period_and_once_when_idle():
    t = Trimmer(every=3600.0)
    assert t.wait is None  # nothing ran: an idle worker sleeps until woken
    t.trim()
    t.trim()
    assert t.trims == 0  # within the period: nothing
    assert t.wait == 3600.0  # work ran: the idle worker wakes after a period to hand its pages back
    t.idle()
    assert t.trims == 1 and t.wait is None
    t.idle()
    assert t.trims == 1  # nothing ran since
    eager = Trimmer(every=0.0)
    eager.trim()
    eager.trim()
    assert eager.trims == 2


def test_the_engine_trims_when_it_goes_idle(tiny_model):
    handle = tiny_model("llama")
    engine = Engine(handle, EngineSettings(window=32, sinks=4, evict_chunk=8))
    try:
        done = threading.Event()
        engine.submit(
            Request(
                ids=list(range(5, 45)),
                max_new_tokens=3,
                sampling=GREEDY,
                emit=lambda ev: done.set() if ev[0] in ("done", "error") else None,
            )
        )
        assert done.wait(60)
        deadline = time.monotonic() + 30
        while engine.heap.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.heap.trims >= 1
    finally:
        engine.stop()
