"""Benchmark: kvlab's quantizers and eviction policies vs kvpress presses and transformers' QuantizedCache.

One command, one run: the anchors (kvpress 0.5.5 presses and QuantizedCache with the quanto backend,
in their own venv with transformers 5.2.0, ``benchmarks/anchors/``) start in a background process on
the very same token ids and needle prompts, while kvlab's compression experiment runs in this process
on N windows of Frankenstein (1,500 context tokens, the next 256 teacher-forced). Both sides use one
torch thread and run at the same time, so they see the same machine load. The anchor worker rewrites
its JSON after every setup and survives a failing setup; if it dies or times out, the table is written
with the setups it finished (marked PARTIAL). Prints a markdown table and writes
``benchmarks/results/compression.md`` (command, machine, date, acceptance checks).

    python3 benchmarks/compression.py                 # full run (~35-45 min on a shared 2-core box)
    python3 benchmarks/compression.py --windows 1 --no-anchors   # kvlab only, quick look
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
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from _common import write_page

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
RESULTS = HERE / "results" / "compression.md"
ANCHOR_JOB, ANCHOR_OUT, ANCHOR_LOG = (
    OUT / "anchors-job.json",
    OUT / "anchors-result.json",
    OUT / "anchors.log",
)
PRESSES = ("tova", "expected_attention", "snapkv", "knorm", "streaming_llm")
NEEDLE_KVLAB = [
    "pertoken int4",
    "rotation+sinks int4",
    "rotation+sinks int2",
    "kivi+sinks int2",
    "kivi+sinks int4",
    "window 50%",
    "streaming_llm 50%",
    "h2o 50%",
    "snapkv 50%",
    "tova 50%",
    "knorm 50%",
    "random 50%",
    "learned 50%",
]


def run_kvlab(args) -> dict:
    from kvlab.study.experiments import ExperimentContext, get_experiment
    from kvlab.study.runner import run_experiment

    out_dir = OUT / "compression-kvlab"
    if args.reuse_kvlab:
        return {"summary": json.loads((out_dir / "result.json").read_text())["summary"], "dir": str(out_dir)}
    ctx = ExperimentContext(
        out_dir=out_dir,
        profile="full",
        seed=args.seed,
        options=dict(
            context_tokens=args.context,
            continuation_tokens=args.continuation,
            windows=args.windows,
            needle_lengths=args.needle_lengths,
            needle_depths=args.needle_depths,
            needle_configs=NEEDLE_KVLAB,
            timing_steps=args.timing_steps,
        ),
    )
    result = run_experiment(get_experiment("compression"), ctx)
    return {"summary": result.summary, "dir": str(out_dir)}


def anchor_job(args) -> dict:
    from kvlab import load_model
    from kvlab.model.loading import bundled_model_dir
    from kvlab.study.experiments.compression import evaluation_text, evaluation_windows, needle_trials

    handle = load_model("smollm2-135m")
    src = evaluation_text(None)
    wins = evaluation_windows(handle, src, args.context, args.continuation, args.windows, args.seed)
    trials = needle_trials(handle, src, args.needle_lengths, args.needle_depths)
    return {
        "kind": "compression",
        "model_dir": str(bundled_model_dir()),
        "context_tokens": args.context,
        "windows": wins,
        "keeps": [0.5],
        "presses": list(PRESSES),
        "quanto_bits": [4, 2],
        "needle": [{"context": c, "question": q, "word": w} for c, q, w in trials],
        "needle_setups": [f"kvpress {p} 50%" for p in PRESSES]
        + ["QuantizedCache quanto int4", "QuantizedCache quanto int2"],
        "timing_steps": args.timing_steps,
        "threads": 1,
        "text_source": src.source,
    }


def start_anchors(args):
    """Write the job and start the anchor worker in the background: ``(process | None, failure)``."""
    sys.path.insert(0, str(HERE / "anchors"))
    from run_anchors import start

    OUT.mkdir(parents=True, exist_ok=True)
    ANCHOR_OUT.unlink(missing_ok=True)
    try:
        ANCHOR_JOB.write_text(json.dumps(anchor_job(args)))
        return start(ANCHOR_JOB, ANCHOR_OUT, ANCHOR_LOG), ""
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        return None, f"anchors failed to start: {exc}"


def finish_anchors(proc, timeout_min: float) -> tuple[dict | None, str]:
    """Wait for the worker; whatever it wrote (all setups, or those done before a crash/timeout)."""
    failure = ""
    try:
        rc = proc.wait(timeout=timeout_min * 60)
        if rc != 0:
            failure = f"anchor worker exited with code {rc} (log: {ANCHOR_LOG.relative_to(HERE.parent)})"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        failure = f"anchor worker stopped after the {timeout_min:.0f}-minute timeout"
    if ANCHOR_OUT.is_file():
        return json.loads(ANCHOR_OUT.read_text()), failure
    if ANCHOR_LOG.is_file() and ": ppl " in ANCHOR_LOG.read_text():
        return anchors_from_log(ANCHOR_LOG), failure
    return None, failure or "anchor worker wrote nothing"


def anchors_from_log(path: Path) -> dict:
    """Rows (mean perplexity only) from the worker's stderr log, for a run stopped before it wrote its JSON."""
    rows = []
    for line in path.read_text().splitlines():
        if ": ppl " not in line:
            continue
        name, value = line.rsplit(": ppl ", 1)
        kind = "full" if name == "full precision" else "press" if name.startswith("kvpress") else "quanto"
        keep = float(name.rsplit(" ", 1)[1].rstrip("%")) / 100 if kind == "press" else None
        rows.append({"name": name, "kind": kind, "keep": keep, "ppl": [float(value)], "needle": []})
    pins = dict(p.split("==") for p in ("kvpress==0.5.5", "transformers==5.2.0", "optimum-quanto==0.2.7"))
    return {"rows": rows, "versions": pins, "complete": False, "setups_total": "?", "from_log": True}


def _fmt_needle(hits: list[float] | None) -> str:
    if not hits:
        return "—"
    return f"{int(sum(hits))}/{len(hits)}"


def build_table(kv: dict, anchors: dict | None) -> tuple[list[list], dict]:
    s = kv["summary"]
    configs = s["configs"]
    full_ms = s.get("decode_ms", {}).get("full precision")
    rows = []
    trials = len(s.get("needle_trials", []))
    for name, c in configs.items():
        nd = c.get("needle_accuracy")
        needle = f"{round(nd * trials)}/{trials}" if nd is not None else "—"
        ms = s.get("decode_ms", {}).get(name)
        rows.append(
            [
                "kvlab",
                name,
                round(c["bytes_per_token"]),
                c["ppl"],
                c["ppl_increase_pct"],
                needle,
                ms,
                ms / full_ms if ms and full_ms else None,
            ]
        )
    checks: dict = {}
    if anchors:
        ok_rows = [r for r in anchors["rows"] if r.get("ppl")]
        base = next((r for r in ok_rows if r["name"] == "full precision"), None)
        if base is None:
            return rows, {"anchors_partial": True}
        base_ppl = np.mean(base["ppl"])
        for r in anchors["rows"]:
            if not r.get("ppl"):
                rows.append(
                    [
                        f"anchor (tf {anchors['versions']['transformers']})",
                        r["name"],
                        None,
                        None,
                        None,
                        f"FAILED: {r.get('error', '?')}",
                        None,
                        None,
                    ]
                )
                continue
            ppl = float(np.mean(r["ppl"]))
            inc = 100 * float(np.mean(np.array(r["ppl"]) / np.array(base["ppl"]) - 1))
            ms, base_ms, bpt = r.get("decode_ms"), base.get("decode_ms"), r.get("bytes_per_token")
            rows.append(
                [
                    f"anchor (tf {anchors['versions']['transformers']})",
                    r["name"],
                    round(bpt) if bpt is not None else None,
                    ppl,
                    inc,
                    _fmt_needle(r["needle"]),
                    ms,
                    ms / base_ms if ms and base_ms else None,
                ]
            )
        checks["anchor_full_ppl"] = float(base_ppl)
        presses = [r for r in ok_rows if r["kind"] == "press" and abs(r["keep"] - 0.5) < 1e-9]
        if presses:
            best = min(presses, key=lambda r: np.mean(r["ppl"]))
            checks["best_press"] = best["name"]
            checks["best_press_ppl"] = float(np.mean(best["ppl"]))
            checks["best_press_needle"] = float(np.mean(best["needle"])) if best["needle"] else None
            checks["best_press_needle_max"] = max(
                (float(np.mean(r["needle"])) for r in presses if r["needle"]), default=float("nan")
            )
        checks["anchors_partial"] = not anchors.get("complete", True) or len(ok_rows) < len(anchors["rows"])
    return rows, checks


def acceptance(kv: dict, checks: dict) -> list[str]:
    from kvlab.study.report.format import format_interval

    c = kv["summary"]["configs"]
    lines = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    for sink in ("", "+sinks"):
        r, n = c.get(f"rotation{sink} int4"), c.get(f"pertoken{sink} int4")
        if r and n:
            ratio = r["out_rel_error"] / n["out_rel_error"]
            lines.append(
                f"- {verdict(ratio <= 0.5)}: rotation{sink} int4 attention-output error / pertoken{sink} int4 = "
                f"{r['out_rel_error']:.4f} / {n['out_rel_error']:.4f} = {ratio:.3f} (target <= 0.5; "
                f"bytes/token {r['bytes_per_token']:.0f} vs {n['bytes_per_token']:.0f})"
            )
            lines.append(
                f"- {verdict(r['ppl_increase_pct'] <= 1.0)}: rotation{sink} int4 perplexity increase "
                f"(%) {format_interval(r['ppl_increase'], signed=True)} (target <= 1%)"
            )
    two = {
        k: v
        for k, v in c.items()
        if v["kind"] == "quant"
        and v["budget"] == 2.0
        and (k.startswith("kivi") or k.startswith("rotation+sinks"))
    }
    if two:
        best = min(two, key=lambda k: two[k]["ppl_increase_pct"])
        lines.append(
            f"- {verdict(two[best]['ppl_increase_pct'] <= 10)}: best 2-bit KIVI / rotation+sinks = {best}, "
            f"perplexity {two[best]['ppl_increase_pct']:+.2f}% (target <= 10%)"
        )
    half = {k: v for k, v in c.items() if v["kind"] == "evict" and v["budget"] == 0.5}
    if half and checks.get("best_press"):
        best = min(half, key=lambda k: half[k]["ppl"])
        nd = half[best].get("needle_accuracy")
        # "at or below": equal within float noise (1e-4 relative) counts as at
        ok_ppl = half[best]["ppl"] <= checks["best_press_ppl"] * (1 + 1e-4)
        lines.append(
            f"- {verdict(ok_ppl)}: best kvlab policy at 50% = {best}, perplexity {half[best]['ppl']:.4f} vs best "
            f"kvpress press {checks['best_press']} {checks['best_press_ppl']:.4f} (kvlab full precision "
            f"{kv['summary']['full_precision_ppl']:.3f}, kvpress-side full precision {checks['anchor_full_ppl']:.3f})"
        )
        if nd is not None and checks.get("best_press_needle") is not None:
            lines.append(
                f"- {verdict(nd >= checks['best_press_needle'])}: needle accuracy of {best} {nd:.2f} vs "
                f"{checks['best_press']} {checks['best_press_needle']:.2f} (best of any press: "
                f"{checks['best_press_needle_max']:.2f})"
            )
    if checks.get("anchors_partial"):
        lines.append(
            "- NOTE: the anchors run did not finish every setup; 'best kvpress press' is the best of "
            "those that finished, so the eviction comparison is provisional."
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--needle-lengths", type=int, nargs="+", default=[512, 1024, 1500])
    ap.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--timing-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-anchors", action="store_true", help="skip kvpress / QuantizedCache")
    ap.add_argument("--reuse-kvlab", action="store_true", help="merge the last kvlab run in benchmarks/out")
    ap.add_argument(
        "--anchors-json", type=Path, help="merge an anchors result already computed on the same job"
    )
    ap.add_argument(
        "--anchors-log", type=Path, help="merge the perplexities an unfinished anchors run logged"
    )
    ap.add_argument(
        "--anchors-timeout", type=float, default=45, help="minutes to wait for the anchors after kvlab's part"
    )
    ap.add_argument("--write-job", type=Path, help="only write the anchors job file and exit")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.write_job:
        args.write_job.write_text(json.dumps(anchor_job(args)))
        return
    started = time.time()
    proc, failure, anchors = None, "", None
    if args.anchors_log:
        anchors = anchors_from_log(args.anchors_log)
    elif args.anchors_json:
        anchors = json.loads(args.anchors_json.read_text())
    elif args.no_anchors:
        failure = "anchors skipped (--no-anchors)"
    else:
        proc, failure = start_anchors(args)
    try:
        kv = run_kvlab(args)
    except BaseException:
        if proc is not None:
            proc.kill()
        raise
    kv_s = time.time() - started
    if proc is not None:
        anchors, failure = finish_anchors(proc, args.anchors_timeout)
    rows, checks = build_table(kv, anchors)
    head = ["side", "method", "bytes/token", "perplexity", "Δ ppl %", "needle", "ms/token", "× own full"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else ("—" if v is None else str(v)) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    acc = acceptance(kv, checks)
    cmd = "python3 " + " ".join(
        [
            str(Path(sys.argv[0]).relative_to(HERE.parent))
            if Path(sys.argv[0]).is_absolute()
            else sys.argv[0],
            *sys.argv[1:],
        ]
    )
    md = [
        "# Compression benchmark: kvlab vs kvpress and transformers' QuantizedCache",
        "",
        f"- command: `{cmd}`",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; wall time "
        f"{(time.time() - started) / 60:.1f} min (kvlab part {kv_s / 60:.1f} min; the anchors ran concurrently "
        "in their own process)",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), torch threads 1 on both "
        f"sides, torch {torch.__version__}",
        f"- data: {kv['summary'].get('windows')} windows of {args.context} context + {args.continuation} teacher-forced "
        f"tokens ({'; '.join(_sources(kv))}); needle: lengths {args.needle_lengths} x depths {args.needle_depths}, "
        "context compressed without the question, same token ids on both sides",
        f"- anchors: {json.dumps(anchors['versions']) if anchors else failure}"
        + (f" — {failure}" if anchors and failure else "")
        + (
            f" — PARTIAL: {len(anchors['rows'])} of {anchors.get('setups_total', '?')} setups finished"
            + (" (mean perplexity only, read from the worker's log)" if anchors.get("from_log") else "")
            if anchors and not anchors.get("complete", True)
            else ""
        ),
        "- perplexity: teacher-forced continuation on the compressed context; Δ ppl % is relative to each side's "
        "own full-precision row (same weights, different transformers versions). ms/token: median decode step on "
        "the compressed cache, ratio to that side's own full precision in the same run (noisy on a shared box).",
        "",
        table,
        "",
        "## Acceptance checks (same run)",
        "",
        *acc,
        "",
        f"Raw results: `{kv['dir']}` (result.json, arrays.npz, figures) and `benchmarks/out/anchors-result.json` (log: `benchmarks/out/anchors.log`).",
    ]
    write_page(RESULTS, "\n".join(md) + "\n")
    print("\n".join(md))


def _sources(kv: dict) -> list[str]:
    path = Path(kv["dir"]) / "result.json"
    try:
        return json.loads(path.read_text()).get("data_sources", [])
    except (OSError, json.JSONDecodeError):
        return []


if __name__ == "__main__":
    main()
