"""``kvlab serve`` fixes glibc's mmap threshold (``cli/serve.py:fix_mmap_threshold``).

By default glibc raises the threshold each time a mapped block is freed, so a dropped session's cache buffers
make the next session's buffers come from the heap, which keeps every page any buffer there ever wrote; on the
bundled model resident memory climbed from 1.4 GB to 3.2 GB over 1,000 sessions
(``benchmarks/results/serve_sessions_smollm2.md`` has the run with the fix). The allocator's behaviour is
checked here in fresh processes: a 1 MiB tensor freed and allocated again comes from the heap without the
fix, and keeps a mapping of its own with it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only"),
]

PROBE = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = Info
if {fix}:
    from kvlab.cli.serve import fix_mmap_threshold; fix_mmap_threshold()
before = libc.mallinfo2().hblks
first = torch.empty(2**18)  # 1 MiB: above the default threshold, so mapped
del first                   # without the fix, freeing it raises the threshold to 1 MiB
again = [torch.empty(2**18) for _ in range(4)]
print(libc.mallinfo2().hblks - before)
"""


def _mapped_blocks(fix: bool) -> int:
    env_probe = PROBE.format(fix=fix)
    out = subprocess.run([sys.executable, "-c", env_probe], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_freed_buffers_stay_mapped_with_the_fix():
    assert _mapped_blocks(fix=False) < 4  # the problem: the next buffers come from the heap
    assert _mapped_blocks(fix=True) >= 4  # fixed: each keeps a mapping, returned to the system when freed
