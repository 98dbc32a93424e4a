"""Benchmark: calibrate the RULER-style tasks on a model (``--model``, the bundled one by default), per
length, on the full cache only.

For each task and length, :func:`kvlab.eval.calibrate.calibrate` walks the task's difficulty ladder
(:data:`kvlab.eval.calibrate.LADDERS`) on calibration seeds (-1, -2, ...: never an evaluation trial's)
and picks the setting whose full-cache accuracy lies in [0.6, 0.95], nearest 0.8; tasks with none are
marked apart. Each trial is built by :func:`kvlab.eval.tasks.make_trial` with the setting's knobs and run
by :func:`kvlab.eval.run.run_trial` with the full cache, exactly as ``benchmarks/eval_ruler.py`` runs it.

Writes the calibration JSON (``--out``, default ``benchmarks/results/ruler_calibration.json``: what
``benchmarks/eval_ruler.py --calibration`` reads; every setting's per-trial seeds, scores and outputs in
it) and the report (``--results``, default ``benchmarks/results/ruler_calibration.md``); each setting
is also appended to ``<out>.progress.jsonl`` as it finishes, and each trial to ``<out>.trials.jsonl``:
``--resume`` replays a stopped run from those trials and runs only the rest.

    nice -n 10 python3 benchmarks/calibrate_ruler.py --lengths 1024          # about 35 min on 1 thread
    nice -n 10 python3 benchmarks/calibrate_ruler.py --lengths 1024 --resume # go on after a stop
    python3 benchmarks/calibrate_ruler.py --report-only                      # re-write the report
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Refusal, model_label, run_main  # noqa: E402

ROOT = HERE.parent
OUT = HERE / "results" / "ruler_calibration.json"
RESULTS = HERE / "results" / "ruler_calibration.md"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from kvlab.eval.calibrate import MIN_TRIALS
    from kvlab.eval.tasks import TASKS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tasks", default=",".join(TASKS), help="tasks, comma-separated")
    ap.add_argument("--n", type=int, default=MIN_TRIALS, help=f"trials per setting (at least {MIN_TRIALS})")
    ap.add_argument("--no-stop-early", action="store_true", help="run every setting's n trials")
    ap.add_argument("--no-refine", action="store_true", help="stop at the first setting in the band")
    ap.add_argument("--haystack", type=Path, help="a text file to hide the facts in (default: kvlab's)")
    ap.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m (bundled), gemma3-270m (the optional package)"
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=OUT, help="the calibration JSON")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the report")
    ap.add_argument("--report-only", action="store_true", help="re-write the report from --out")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="reuse the trials an earlier run of the same command recorded (<out>.trials.jsonl): the walk "
        "replays them and runs only the trials it has not run",
    )
    args = ap.parse_args(argv)
    args.length_list = [int(v) for v in args.lengths.split(",") if v.strip()]
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.task_list if t not in TASKS]
    if unknown:
        raise Refusal(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    if args.n < MIN_TRIALS:
        raise Refusal(f"--n {args.n}: a setting needs at least {MIN_TRIALS} trials")
    return args


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def _key(task: str, length: int, seed: int, knobs: Mapping[str, int]) -> str:
    return json.dumps([task, int(length), int(seed), sorted(knobs.items())])


def recorded(trials: Path) -> dict[str, dict]:
    """The trials an earlier run recorded in ``trials`` (one JSON line each, keyed as :func:`_key`)."""
    if not trials.exists():
        return {}
    out = {}
    for line in trials.read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            out[doc["key"]] = doc["row"]
    return out


def scorer(handle: Any, text: str, trials: Path, memo: Mapping[str, dict]) -> Any:
    """``score(task, length, seed, knobs)``: one trial on the full cache (:func:`kvlab.eval.run.run_trial`),
    as a raw row, appended to ``trials`` as it finishes; a trial in ``memo`` (a resumed run's) is not run
    again (the walk is a function of the trials' scores, so it replays the same way)."""
    from kvlab.eval.run import run_trial
    from kvlab.eval.specs import parse_cache_specs
    from kvlab.eval.tasks import make_trial

    full = parse_cache_specs(["full"])

    def score(task: str, length: int, seed: int, knobs: Mapping[str, int]) -> dict:
        key = _key(task, length, seed, knobs)
        if key in memo:
            return memo[key]
        t0 = time.perf_counter()
        trial = make_trial(task, handle, length, seed, text, knobs)
        (row,) = run_trial(handle, trial, full)
        out = {
            "seed": seed,
            "score": row["score"],
            "output": row["output"],
            "answers": row["answers"],
            "prompt_tokens": row["context_tokens"] + row["question_tokens"],
            "seconds": round(time.perf_counter() - t0, 2),
        }
        with open(trials, "a") as f:
            f.write(json.dumps({"key": key, "row": out}) + "\n")
        return out

    return score


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    import torch

    from kvlab import load_model
    from kvlab.data import default_long_text, read_text_file
    from kvlab.eval.calibrate import calibrate

    torch.set_num_threads(max(1, args.threads))
    source = read_text_file(args.haystack) if args.haystack else default_long_text()
    handle = load_model(args.model, device="cpu", dtype=args.dtype)
    progress = args.out.with_name(args.out.name + ".progress.jsonl")
    trials = args.out.with_name(args.out.name + ".trials.jsonl")
    progress.parent.mkdir(parents=True, exist_ok=True)
    memo = recorded(trials) if args.resume else {}
    if not args.resume:
        trials.write_text("")
    progress.write_text("")
    started = time.time()

    def on_setting(task: str, length: int, setting: dict) -> None:
        with open(progress, "a") as f:
            f.write(json.dumps({"task": task, "length": length, **setting}) + "\n")
        acc = setting["accuracy"]["value"]
        print(
            f"{task} @ {length} {setting['knobs'] or 'default'}: {acc:.2f} over {setting['n']} "
            f"({setting['verdict']}; {(time.time() - started) / 60:.1f} min)",
            file=sys.stderr,
            flush=True,
        )

    about = {
        "model": model_label(args.model),
        "model_spec": args.model,
        "dtype": args.dtype,
        "device": "cpu",
        "threads": args.threads,
        "haystack": source.source,
        "command": "python3 benchmarks/calibrate_ruler.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
    }
    doc = calibrate(
        scorer(handle, source.text, trials, memo),
        args.task_list,
        args.length_list,
        n=args.n,
        stop_early=not args.no_stop_early,
        refine=not args.no_refine,
        on_setting=on_setting,
        about=about,
    )
    doc["wall_minutes"] = round((time.time() - started) / 60, 1)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _acc(a: Mapping) -> str:
    if a["low"] is None:
        return f"{a['value']:.2f} (n = {a['n']}, no interval)"
    return f"{a['value']:.2f} [{a['low']:.2f}, {a['high']:.2f}]"


def _knobs(k: Mapping) -> str:
    return ", ".join(f"{n}={v}" for n, v in k.items()) or "default"


def report_lines(doc: Mapping) -> list[str]:
    """The chosen settings, then every setting tried (its trials' seeds, scores and time)."""
    from kvlab.eval.tasks import TASKS

    lines = [
        "| length | task | status | knobs | n | full-cache accuracy [Wilson 95%] | settings tried |",
        "|---:|---|---|---|---:|---|---:|",
    ]
    for e in doc["tasks"]:
        lines.append(
            f"| {e['length']} | {e['task']} | {e['status']} | {_knobs(e['knobs'])} | {e['n']} | "
            f"{_acc(e['accuracy'])} | {len(e['tried'])} |"
        )
    lines += [
        "",
        "Every setting tried, in the order of the ladder (defaults: "
        + "; ".join(f"{t} {_knobs(TASKS[t].knobs)}" for t in dict.fromkeys(e["task"] for e in doc["tasks"]))
        + "):",
        "",
        "| length | task | knobs | n | accuracy [Wilson 95%] | verdict | interval inside the band | stopped early | seconds per trial |",
        "|---:|---|---|---:|---|---|---|---|---:|",
    ]
    for e in doc["tasks"]:
        for t in e["tried"]:
            secs = [r["seconds"] for r in t.get("rows", [])]
            per = f"{sum(secs) / len(secs):.1f}" if secs else "—"
            lines.append(
                f"| {e['length']} | {e['task']} | {_knobs(t['knobs'])} | {t['n']} | {_acc(t['accuracy'])} | "
                f"{t['verdict']} | {'yes' if t['interval_in_band'] else 'no'} | "
                f"{'yes' if t['stopped_early'] else 'no'} | {per} |"
            )
    return lines


def _where(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def report(doc: Mapping, out: Path) -> list[str]:
    """The result file: a summary block (one row per length), how it ran, the tables."""
    lengths = sorted({e["length"] for e in doc["tasks"]})
    rows = []
    for n in lengths:
        at = [e for e in doc["tasks"] if e["length"] == n]
        pooled = [e for e in at if e["status"] == "pooled"]
        names = [e["task"] for e in at if e["status"] == "apart"]
        apart = ", ".join(names) if len(names) <= 2 else str(len(names))
        spec = doc.get("model_spec", "smollm2-135m")
        what = "RULER tasks" if spec == "smollm2-135m" else f"{doc['model'].split(' (')[0]}: tasks"
        rows.append(  # short: BENCHMARKS.md has a size cap
            f"| quality | {what} calibrated ({n // 1024}k) | **{len(pooled)} of {len(at)}** in "
            f"[0.6, 0.95]; {apart} apart | full cache, {doc['threads']} thread{'s' * (doc['threads'] > 1)} | CPU 2 cores | "
            f"{doc['date'][:10]} | {doc['commit']} | current |"
        )
    trials = sum(t["n"] for e in doc["tasks"] for t in e["tried"])
    return [
        f"## RULER-style tasks calibrated on the full cache: {doc['model']}, {', '.join(map(str, lengths))} tokens",
        "",
        "<!-- summary -->",
        "| theme | claim | figure | versus | machine | date | commit | status |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "<!-- /summary -->",
        "",
        f"- command: `nice -n 10 {doc['command']}` (`benchmarks/calibrate_ruler.py`, "
        "`kvlab.eval.calibrate.calibrate`)",
        f"- date: {doc['date']}; wall time {doc.get('wall_minutes', '?')} min for {trials} trials",
        f"- machine: {doc['machine']}, shared with other jobs; {doc['device']}, {doc['threads']} torch thread",
        f"- model: {doc['model']}, {doc['dtype']}; haystack: {doc['haystack']}; commit {doc['commit']}",
        "- rule: per task, its ladder walked on the full cache (a bisection from the default; "
        f"`kvlab.eval.calibrate.LADDERS`), {doc['n']} trials per setting on calibration seeds "
        f"{doc['seeds']['first']} to {doc['seeds']['last']} (an eval's seeds are >= 0), band "
        f"[{doc['band'][0]}, {doc['band'][1]}] on the mean score, nearest {doc['target']} preferred; "
        + (
            "a setting stops once its remaining trials cannot bring it into the band (its n is then smaller)"
            if doc["stop_early"]
            else "every setting ran all its trials"
        ),
        "- the calibration (what `benchmarks/eval_ruler.py --calibration` reads; every setting's seeds, "
        f"scores and outputs): `{_where(out)}`",
        "",
        *report_lines(doc),
        "",
    ]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report_only:
        if not args.out.exists():
            raise Refusal(f"--report-only: no calibration at {args.out}")
        doc = json.loads(args.out.read_text())
    else:
        doc = run(args, argv)
    md = report(doc, args.out)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    run_main(main)
