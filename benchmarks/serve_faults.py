"""Reliability of ``kvlab serve`` on a shared store (issue 48 item 7): runs ``tests/test_serve_faults.py`` and
writes what each fault test measured, with its outcome and time, to benchmarks/results/serve_faults.md.

The tests (real ``kvlab serve`` subprocesses on 127.0.0.1, a tiny random model from a local folder, every
reply compared token for token with a server that reused nothing): two replicas on one disk store and on one
Redis under concurrent shared-prefix requests; a server stopped by SIGTERM or SIGKILL with four streams open,
then restarted on its store; a client that stops reading its reply while the server is told to stop; a
replica killed in the middle of a block write (disk, Redis), then two blocks torn at rest. Each test prints
its figures; they are read here from pytest's JUnit report (``junit_logging=system-out``).

Run: python3 benchmarks/serve_faults.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_main, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/test_serve_faults.py"


def run_tests(junit: Path) -> tuple[int, float]:
    """pytest on the fault tests: (exit code, seconds)."""
    cmd = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider"]
    cmd += ["-o", "junit_logging=system-out", f"--junitxml={junit}"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"pytest exited {done.returncode}")
    return done.returncode, time.monotonic() - t0


def rows(junit: Path) -> list[str]:
    out = ["| test | outcome | seconds | what it measured |", "|---|---|---|---|"]
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "skipped" if case.find("skipped") is not None else ("**FAILED**" if failed else "passed")
        printed = (case.findtext("system-out") or "").strip()
        lines = [line.strip() for line in printed.splitlines()]
        figures = " ".join(x for x in lines if x and not x.startswith("---")) or "-"  # not pytest's banner
        out.append(f"| `{case.get('name')}` | {outcome} | {float(case.get('time', 0)):.1f} | {figures} |")
    return out


def main() -> None:
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code, took = run_tests(junit)
        table = rows(junit)
    body = f"""
`python -m pytest {TEST}` (what each test prints is its figures). Load average at the start {load0:.1f}, at
the end {os.getloadavg()[0]:.1f} (2 cores shared with other jobs); {took / 60:.1f} minutes in all.

{chr(10).join(table)}

- *two replicas*: 24 requests (4 documents x 3 questions x 2 replicas) from 4 clients at once, after one
  probe that the second replica loads what the first stored; every reply equal to the no-reuse server's
  (token ids, log-probabilities within 2e-3); "from disk/redis": loaded (in part) from the shared tier
  rather than the replica's own memory tier; then `kvlab store verify` exit 0, no bad block.
- *stopped with streams open*: seconds from the signal to each client's end of stream; SIGTERM drains
  (`[DONE]`, equal to the reference), SIGKILL cuts (EOF, what came equal to the reference's beginning);
  restarted on the store, the same prompts are store hits equal to the reference; verify exit 0.
- *stops reading*: `--shutdown-timeout 3`; without it the server was still running 60 s after SIGTERM.
- *killed mid store write*: blocks cut mid-write (disk: a temporary file; Redis: an index entry without its
  block); a verify right after the kill is clean; two blocks then torn at rest are reported (exit 1), the
  restarted replica serves every prompt equal to the reference, moves them out and writes them again.

**Verdict: {"pass" if code == 0 else "FAIL"}.**
"""
    write_results("serve_faults", "Reliability: replicas, restarts and kill -9 on one store", body)


if __name__ == "__main__":
    run_main(main)
