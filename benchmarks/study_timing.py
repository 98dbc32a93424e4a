"""Time ``kvlab study`` end to end, as a user runs it, with each experiment's time and peak memory.

Runs the real command (``python -m kvlab study``, in a subprocess, with its default worker processes
unless ``--workers`` is given) and times it from start to exit; each experiment's seconds (in the worker
that ran it) and status come from the run folder's ``result.json`` files, and the peak resident memory
of the command's whole process tree is sampled every 50 ms (psutil). Timings on a shared machine are
noisy, so each figure is also expressed in units of one 1,000-token prefill measured in this process
before and after the run (averaged).

    python3 benchmarks/study_timing.py                      # every experiment, default profile
    python3 benchmarks/study_timing.py --profile quick     # writes results/study_timing_quick.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import sys
import threading
import time
from pathlib import Path

from _common import write_page

HERE = Path(__file__).resolve().parent


class TreePeakRSS:
    """Peak summed RSS (bytes) of a process and all its descendants, sampled in a background thread."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        import psutil

        self._root = psutil.Process(pid)
        self._psutil = psutil
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0
            with contextlib.suppress(self._psutil.Error):  # the command has exited
                for p in [self._root, *self._root.children(recursive=True)]:
                    with contextlib.suppress(self._psutil.Error):  # a worker has just exited
                        total += p.memory_info().rss
            self.peak = max(self.peak, total)
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=2)
        return self.peak


def prefill_seconds(model, tokens: int = 1000) -> float:
    ids = model.encode(" ".join(["the cache holds keys and values"] * (tokens // 5)))[:tokens]
    t0 = time.perf_counter()
    model.prefill(ids, all_logits=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="default", choices=["quick", "default", "full"])
    ap.add_argument("--only", action="append", help="experiment name (repeatable); default: all in the study")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workers", type=int, help="passed to kvlab study (default: kvlab's own default)")
    ap.add_argument("--out", default=str(HERE / "out" / "study_timing"))
    ap.add_argument("--results", help="default: results/study_timing.md, or study_timing_<profile>.md")
    args = ap.parse_args(argv)

    import json
    import subprocess

    import torch

    from kvlab.model import load_model
    from kvlab.study.runner import default_workers

    model = load_model(args.model)
    unit_before = prefill_seconds(model)
    out = Path(args.out) / args.profile
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("study-*"))
    cmd = [sys.executable, "-m", "kvlab", "study", "--model", args.model, "--out", str(out)]
    cmd += {"quick": ["--quick"], "full": ["--full"], "default": []}[args.profile]
    cmd += [x for name in args.only or [] for x in ("--only", name)]
    workers = args.workers or default_workers()
    cmd += ["--workers", str(workers)]
    print("running:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    rss = TreePeakRSS(proc.pid)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    peak = rss.stop()
    unit_after = prefill_seconds(model)
    unit = (unit_before + unit_after) / 2
    new = sorted(set(out.glob("study-*")) - before)
    if not new:
        print(f"kvlab study exited {rc} without a run folder", file=sys.stderr)
        return 1
    root = new[-1]
    study = json.loads((root / "result.json").read_text())
    seconds: dict[str, float] = study["summary"]["seconds"]
    rows = []
    for name, sec in seconds.items():
        status = json.loads((root / name / "result.json").read_text()).get("status", "?")
        rows.append((name, float(sec), status))
    exp_total = sum(r[1] for r in rows)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    command = f"python3 benchmarks/study_timing.py --profile {args.profile}" + "".join(
        f" --only {n}" for n in (args.only or [])
    )
    lines = [
        f"# Study timing ({args.profile} profile)",
        "",
        f"Command: `{command}` (runs `kvlab study{' --quick' if args.profile == 'quick' else ''} "
        f"--workers {workers}`, end to end, in a subprocess)",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average at the end "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        f"Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; model {args.model}; "
        f"{workers} worker process(es), {max(1, (os.cpu_count() or 1) // workers)} torch thread(s) each",
        f"Unit: one 1,000-token prefill took {unit_before:.2f} s before and {unit_after:.2f} s after the run "
        f"(in this process, {torch.get_num_threads()} torch threads; the unit columns divide by their mean).",
        "",
        "| experiment | seconds (in its worker) | share of experiment time | 1k-token prefills | status |",
        "|---|---:|---:|---:|---|",
    ]
    for name, sec, status in rows:
        lines.append(f"| {name} | {sec:.1f} | {sec / exp_total:.1%} | {sec / unit:.0f} | {status} |")
    lines += [
        f"| **the command, start to exit** | **{wall:.1f}** | | {wall / unit:.0f} | exit {rc} |",
        "",
        f"Sum of the experiments' own times: {exp_total:.1f} s over {workers} worker(s); the command also loads "
        "the model (once per process) and writes the report. Peak resident memory of the whole process tree: "
        f"{peak / 2**20:,.0f} MiB. Every experiment runs at the profile's usual sizes (windows, samples, "
        "bootstrap intervals): workers change where experiments run, not what they measure.",
        "",
        f"Run folder: `{_shown(root)}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = "" if args.profile == "default" else f"_{args.profile}"
    res = Path(args.results or HERE / "results" / f"study_timing{suffix}.md")
    write_page(res, text)
    return 0 if rc == 0 and all(r[2] in ("ok", "not_applicable") for r in rows) else 1


def _shown(path: Path) -> str:
    """A path as a results page may name it: relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
