"""Time kvlab's cheap paths as whole commands: listing the experiments, help, and refused options.

``kvlab experiments``, ``kvlab --help`` and a mistyped ``--cache`` are answered without importing torch
or transformers (tests/test_cheap_paths.py checks that); this measures what a user waits. Each command
runs as its own process (``python -m kvlab ...``, as the ``kvlab`` script runs it), ``--runs`` times after
one warm-up; per run the wall time and the CPU-seconds (user + system, from ``wait4``: they depend little
on other load, wall time does) and the peak resident memory. The load average before and after is
recorded: compare wall times only from an idle machine. ``--src DIR`` times another checkout's
``src`` folder with this interpreter, and ``--before DIR`` a second one in the same table, the two
alternated command by command (e.g. the commit before a change, unpacked with ``git archive``).

    python3 benchmarks/cheap_paths.py                   # writes benchmarks/results/cheap_paths.md
    git archive 156913c src | tar -x -C /tmp/before
    python3 benchmarks/cheap_paths.py --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import Refusal, machine, run_main, write_page, write_results

COMMANDS = {
    "kvlab experiments": ["experiments"],
    "kvlab --help": ["--help"],
    "kvlab eval ruler --help": ["eval", "ruler", "--help"],
    "kvlab generate hi --cache snapkvv:0.5 (refused)": ["generate", "hi", "--cache", "snapkvv:0.5"],
    "kvlab serve --cache snapkv:0.5 (refused: no every=)": ["serve", "--cache", "snapkv:0.5"],
}


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """``python -m kvlab ARGV``: (wall s, CPU s, peak RSS MiB, exit code), its output discarded."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def _env(src: Path | None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    return env


def measure(runs: int, sources: dict[str, Path | None]) -> list[str]:
    """One row per command and source; the sources alternate run by run, so drift hits both alike."""
    rows = []
    for label, argv in COMMANDS.items():
        got: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in sources}
        for src in sources.values():
            run_once(argv, _env(src))  # warm-up: the page cache holds the modules, as on a second call
        for _ in range(runs):
            for name, src in sources.items():
                got[name].append(run_once(argv, _env(src)))
        for name, results in got.items():
            walls, cpus, rss, codes = zip(*results, strict=True)
            rows.append(
                f"| `{label}` | {name} | {_spread(list(walls), '.2f')} | {_spread(list(cpus), '.2f')} | "
                f"{statistics.median(rss):.0f} | {', '.join(map(str, sorted(set(codes))))} |"
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="counted runs per command (after one warm-up)")
    ap.add_argument("--src", type=Path, help="time this src folder instead of the installed kvlab")
    ap.add_argument("--before", type=Path, help="also time this src folder (e.g. the previous commit's)")
    ap.add_argument("--results", type=Path, help="write here instead of benchmarks/results/cheap_paths.md")
    args = ap.parse_args(argv)
    if not 1 <= args.runs <= 100:
        raise Refusal(f"--runs must be between 1 and 100, got {args.runs}")
    for option, src in (("--src", args.src), ("--before", args.before)):
        if src is not None and not (src / "kvlab" / "__init__.py").is_file():
            raise Refusal(f"{option} {src} holds no kvlab package")
    sources = {"now": args.src} | ({"before": args.before} if args.before is not None else {})
    load_before = os.getloadavg()
    rows = measure(args.runs, sources)
    load_after = os.getloadavg()
    where = "; ".join(f"{name}: {src or 'the installed checkout'}" for name, src in sources.items())
    body = "\n".join(
        [
            f"kvlab sources: {where}. {args.runs} runs per command and source after one warm-up each; "
            f"median (min-max). Load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in load_before)}, "
            f"after {'/'.join(f'{x:.1f}' for x in load_after)} on {os.cpu_count()} cores.",
            "",
            "| command | kvlab | wall s | CPU s (user + system) | peak RSS MiB | exit codes |",
            "|---|---|---:|---:|---:|---:|",
            *rows,
        ]
    )
    if args.results is not None:
        write_page(args.results, f"## kvlab's cheap paths\n\nMachine: {machine()}\n\n{body}\n")
        print(args.results.read_text())
        return
    write_results("cheap_paths", "kvlab's cheap paths (listing, help, refusals), whole commands", body)


if __name__ == "__main__":
    run_main(main)
