"""Time each experiment of ``kvlab study`` and the total, with peak memory, in one process.

Runs the experiments in study order exactly as ``kvlab study`` does (one shared model, one output
folder, so later experiments reuse earlier results), recording wall time and the peak resident
memory reached during each one (psutil sampling every 20 ms; ``ru_maxrss`` as a fallback). Timings
on a shared machine are noisy, so each experiment is also expressed as a ratio: its time over the
time of one 1,000-token prefill measured in the same run (before and after, averaged).

    python3 benchmarks/study_timing.py                      # every experiment, default profile
    python3 benchmarks/study_timing.py --only roll_sweep --only roll_long --profile quick
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import resource
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class PeakRSS:
    """Peak RSS (bytes) since the last :meth:`reset`, sampled in a background thread."""

    def __init__(self, interval_s: float = 0.02):
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if self._proc is not None:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def reset(self) -> None:
        self.peak = self._proc.memory_info().rss if self._proc is not None else 0

    def read(self) -> tuple[int, str]:
        if self._proc is not None:
            return max(self.peak, self._proc.memory_info().rss), "psutil"
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (process peak so far)"

    def stop(self) -> None:
        self._stop.set()


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
    ap.add_argument("--out", default=str(HERE / "out" / "study_timing"))
    ap.add_argument("--results", default=str(HERE / "results" / "study_timing.md"))
    args = ap.parse_args(argv)

    import torch

    from kvlab.model import load_model
    from kvlab.study.experiments import ExperimentContext, registry
    from kvlab.study.report.writer import run_dir, to_jsonable
    from kvlab.study.runner import run_experiment

    experiments = [e for e in registry().values() if e.in_study and (not args.only or e.name in args.only)]
    if args.only and len(experiments) != len(set(args.only)):
        known = ", ".join(registry())
        print(f"unknown experiment in {args.only}; known: {known}", file=sys.stderr)
        return 2
    rss = PeakRSS()
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    model = load_model(args.model)
    load_s = time.perf_counter() - t0
    unit_before = prefill_seconds(model)
    root = run_dir(args.out, f"study-{args.profile}")
    rows = []
    upstream: dict[str, dict] = {}  # as the study runner does: later experiments reuse earlier summaries
    for exp in experiments:
        rss.reset()
        ctx = ExperimentContext(
            out_dir=root / exp.name,
            profile=args.profile,
            model_spec=args.model,
            model_handle=model,
            upstream={n: upstream[n] for n in exp.needs if n in upstream},
        )
        t0 = time.perf_counter()
        status = "ok"
        try:
            result = run_experiment(exp, ctx)
            status = result.status
            if status == "ok":
                upstream[exp.name] = to_jsonable(result.summary)
        except Exception as exc:  # a benchmark records a failure and carries on, like the study
            status = f"failed: {type(exc).__name__}: {exc}"[:120]
        seconds = time.perf_counter() - t0
        peak, how = rss.read()
        rows.append((exp.name, seconds, peak, status))
        print(
            f"{exp.name}: {seconds:.1f} s, peak RSS {peak / 2**20:.0f} MiB, {status}",
            file=sys.stderr,
            flush=True,
        )
    unit_after = prefill_seconds(model)
    total = time.perf_counter() - t_all
    rss.stop()
    unit = (unit_before + unit_after) / 2
    exp_total = sum(r[1] for r in rows)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines = [
        f"# Study timing ({args.profile} profile)",
        "",
        f"Command: `python3 benchmarks/study_timing.py --profile {args.profile}"
        + "".join(f" --only {n}" for n in (args.only or []))
        + "`",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average at the end "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        f"Date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}; model {args.model}; memory: {how}",
        f"Unit: one 1,000-token prefill took {unit_before:.2f} s before and {unit_after:.2f} s after the run "
        "(the ratio column divides by their mean, so it survives a busy machine better than seconds).",
        "",
        "| experiment | seconds | share of experiments | 1k-token prefills | peak RSS (MiB) | status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, seconds, peak, status in rows:
        lines.append(
            f"| {name} | {seconds:.1f} | {seconds / exp_total:.1%} | {seconds / unit:.0f} | "
            f"{peak / 2**20:.0f} | {status} |"
        )
    lines.append(
        f"| **total** (incl. model load {load_s:.1f} s) | {total:.1f} | 100% | {total / unit:.0f} | "
        f"{max((r[2] for r in rows), default=0) / 2**20:.0f} | |"
    )
    lines.append("")
    lines.append(f"Run folder: `{root}`")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0 if all(r[3] in ("ok", "not_applicable") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
