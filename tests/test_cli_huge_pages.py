"""The ``kvlab`` command backs torch's large CPU allocations with transparent huge pages (torch's own switch,
``THP_MEM_ALLOC_ENABLE``, set before torch is imported), and a user's own value wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SRC = Path(__file__).resolve().parents[1] / "src"

# In a fresh process: run the command line (its help: nothing is loaded), then allocate and touch 64 MiB with
# torch and print the switch's value and how much of that block's mapping is on huge pages (smaps, in kB).
CHILD = r"""
import os, sys
from kvlab.cli import main
assert "torch" not in sys.modules
main(["--help"])
import torch
x = torch.ones(16 << 20)  # 64 MiB of float32
lo = x.data_ptr()
huge, inside = 0, False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        a, b = (int(v, 16) for v in head.split("-"))
        inside = a <= lo < b
    elif inside and head == "AnonHugePages:":
        huge = int(line.split()[1])
print("SWITCH", os.environ.get("THP_MEM_ALLOC_ENABLE"), "HUGE_KB", huge)
"""


def _thp_mode() -> str:
    """The kernel's THP mode: the bracketed word of ``always [madvise] never``."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text.split("[", 1)[1].split("]", 1)[0]


def _child(env_value: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = str(SRC)
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SWITCH"))
    _, value, _, kb = line.split()
    return value, int(kb)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_command_turns_huge_pages_on_and_a_users_zero_wins() -> None:
    value, kb = _child(None)
    assert value == "1"
    mode = _thp_mode()
    if mode != "never":  # madvise or always: torch's 64 MiB block sits (mostly) on 2 MiB pages
        assert kb >= 32 * 1024, f"THP {mode}: only {kb} kB of a 64 MiB block on huge pages"
    value, kb = _child("0")
    assert value == "0"
    if mode == "madvise":  # nobody asked for huge pages: none
        assert kb == 0
