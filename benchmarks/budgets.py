"""Benchmark: shared budgets — per-head (AdaKV) and per-layer (PyramidKV) — in kvlab's ragged cache, side by side
with kvpress's AdaKVPress(SnapKV) and PyramidKVPress at the same ratio, on the same ids.

kvlab's side: :func:`kvlab.eval.run.run_suite` on the bundled SmolLM2-135M-Instruct (float32, CPU, one
torch thread) with ``full`` and, for SnapKV and H2O at ``keep``, a uniform budget, ``heads=ada`` and
``layers=pyramid`` (:mod:`kvlab.policy.evict.budgets`; the shared ones held as a
:class:`~kvlab.policy.evict.budgets.RaggedCache` and run masked through :meth:`kvlab.model.ModelHandle.forward`). kvpress's side: the
anchor worker's ``ruler`` job (``benchmarks/anchors/anchor_worker.py``, kvpress 0.5.5 in its own venv) on the
ids kvlab ran, presses ``snapkv``, ``adakv_snapkv`` (``AdaKVPress(SnapKVPress)``) and ``pyramidkv``, reusing
``benchmarks/eval_ruler.py``'s recording and merge.

Memory is what each cache holds after the context (K/V bytes): kvlab's ragged cache holds only kept slots;
kvpress's AdaKV holds every key and masks the pruned ones at attention time (its ``attention_patch``), so its
bytes are the full cache's — the table gives both that and what it would hold if it freed them.

    OMP_NUM_THREADS=1 python benchmarks/budgets.py --trials 2      # writes benchmarks/results/budgets.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import eval_ruler as er  # noqa: E402
from _common import write_page  # noqa: E402

OUT = HERE / "out" / "budgets"
RESULTS = HERE / "results" / "budgets.md"
SCORES = ("snapkv", "h2o")
SHARES = ("", ",heads=ada", ",layers=pyramid")
PRESSES = ("snapkv", "adakv_snapkv", "pyramidkv")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from kvlab.eval.tasks import TASKS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2, help="trials per task and length")
    ap.add_argument("--lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tasks", default=",".join(TASKS), help="tasks, comma-separated")
    ap.add_argument("--keep", type=float, default=0.5, help="fraction of the context kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kvpress", action="store_true")
    ap.add_argument(
        "--kvpress-timeout", type=float, default=30, help="minutes to wait for the worker after kvlab"
    )
    ap.add_argument("--out-dir", type=Path, default=OUT)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite the report from --out-dir/result.json"
    )
    args = ap.parse_args(argv)
    args.length_list = [int(v) for v in args.lengths.split(",") if v.strip()]
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return args


def spec_texts(keep: float) -> list[str]:
    return ["full", *(f"{s},keep={keep:g}{share}" for s in SCORES for share in SHARES)]


def _mean(vals: Sequence[float]) -> float:
    return sum(vals) / len(vals) if vals else float("nan")


def _ci(vals: Sequence[float], seed: int) -> dict | None:
    from kvlab.metrics.stats import bootstrap_ci

    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return bootstrap_ci(vals, seed=seed).to_json() if vals else None


def _label(row: dict) -> str:
    return row["spec"] if row.get("side", "kvlab") == "kvlab" else row["spec"]


def summarize(rows: Sequence[dict], seed: int) -> list[dict]:
    """Per (length, cache) pooled over tasks: bytes held (and padded / masked), per-head counts, quality."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], _label(r)), []).append(r)
    out = []
    for (length, label), rs in groups.items():
        out.append(
            {
                "length": length,
                "cache": label,
                "side": rs[0].get("side", "kvlab"),
                "n": len(rs),
                "kv_bytes": _mean([r["kv_bytes"] for r in rs]),
                "kv_bytes_padded": _mean([r.get("kv_bytes_padded", r["kv_bytes"]) for r in rs]),
                "kv_bytes_unmasked": _mean([r.get("kv_bytes_unmasked", r["kv_bytes"]) for r in rs]),
                "head_min": min(r.get("kept_per_head_min", r["kept_slots"]) for r in rs),
                "head_max": max(r.get("kept_per_head_max", r["kept_slots"]) for r in rs),
                "accuracy": _ci([r["score"] for r in rs], seed),
                "kld": _ci([r["kld"] for r in rs], seed),
                "top1": _ci([r["top1"] for r in rs], seed),
                "seconds": sum(r["seconds"] for r in rs),
            }
        )
    return out


def paired(rows: Sequence[dict], seed: int, pairs: Sequence[tuple[str, str]]) -> list[dict]:
    """KL(shared) - KL(uniform) and top-1 differences on the same trials (paired bootstrap)."""
    by = {(r["length"], _label(r), r["task"], r["trial"]): r for r in rows}
    out = []
    lengths = sorted({r["length"] for r in rows})
    for length in lengths:
        for a, b in pairs:
            keys = [k for k in by if k[0] == length and k[1] == a and (length, b, k[2], k[3]) in by]
            if not keys:
                continue
            d_kl = [by[k]["kld"] - by[(length, b, k[2], k[3])]["kld"] for k in keys]
            d_t1 = [by[k]["top1"] - by[(length, b, k[2], k[3])]["top1"] for k in keys]
            out.append(
                {
                    "length": length,
                    "a": a,
                    "b": b,
                    "n": len(keys),
                    "d_kld": _ci(d_kl, seed),
                    "d_top1": _ci(d_t1, seed),
                }
            )
    return out


def _kib(x: float) -> str:
    return f"{x / 1024:,.0f}"


def write_report(args, summary, pairs, meta, path: Path) -> None:
    fmt = er._fmt
    lines = [
        "# Shared budgets: per-head (AdaKV) and per-layer (PyramidKV), kvlab's ragged cache vs kvpress",
        "",
        f"Generated by `python benchmarks/budgets.py {' '.join(meta['argv'])}` on {meta['date']}.",
        "",
        f"**What ran.** `kvlab.eval.run.run_suite` on the bundled {meta['model']} (float32, CPU, one torch thread), "
        f"tasks {', '.join(args.task_list)}, prompt length(s) {args.lengths} tokens, {args.trials} trial(s) per task "
        f"and length (seed {args.seed}): **{meta['trials']} trials** per cache. kvlab caches at keep={args.keep:g}: "
        "uniform (every layer and KV head the same count), `heads=ada` (AdaKV: the layer's budget over all KV heads "
        "together, kvpress's `alpha_safeguard=0.2` floor, sinks/window protected per head) and `layers=pyramid` "
        "(PyramidKV: kvpress's linear formula, beta=20, summing to the same total). kvpress 0.5.5 (anchor worker, "
        "own venv, transformers 5.2.0, one thread) on the same ids at compression_ratio "
        f"{1 - args.keep:g}: `SnapKVPress`, `AdaKVPress(SnapKVPress)`, `PyramidKVPress` (defaults: window 64, "
        "kernel 5, beta 20). The question and answer run uncompressed after the context; KL(P_full || P_cache) "
        "and top-1 agreement are over the question plus the full cache's answer (teacher-forced), each side "
        "against its own full cache; accuracy is kvlab's scorer on each side's greedy answer.",
        "",
        f"**Machine.** {meta['machine']}; 2 cores shared with other jobs (load average at start "
        f"{meta['load_before']}). kvlab side {meta['kvlab_seconds']:.0f} s, wall {meta['wall']:.0f} s.",
        "",
        "**Memory** is the K/V bytes held after the context (per trial, mean; KiB). *held*: what the cache stores. "
        "*padded*: a rectangular per-layer store padded to the layer's largest head (what kvlab pads to while "
        "computing only). *if freed*: kvpress AdaKV's kept keys alone — it holds all of them and masks the pruned "
        "ones, so *held* is the full cache's. *kept/head*: the fewest and most slots one KV head of one layer keeps "
        "over the trials (kvlab); for kvpress, in parentheses, layer 0's cache length (a pyramid's other layers "
        "hold fewer; AdaKV's heads all hold the whole context).",
        "",
        "| length | side | cache | n | held KiB | % of full | padded KiB | if freed KiB | kept/head min–max | accuracy [95% CI] | KL nats [95% CI] | top-1 [95% CI] |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    full = {
        (s["length"], s["side"]): s["kv_bytes"] for s in summary if s["cache"] in ("full", "kvpress full")
    }
    for s in sorted(
        summary,
        key=lambda s: (
            s["length"],
            s["side"] != "kvlab",
            s["cache"] not in ("full", "kvpress full"),
            s["cache"],
        ),
    ):
        ref = full.get((s["length"], s["side"])) or float("nan")
        # kvpress rows report only layer 0's length (a pyramid's layers differ; AdaKV masks inside it)
        heads = (
            f"{s['head_min']}–{s['head_max']}"
            if s["side"] == "kvlab"
            else f"({s['head_min']}–{s['head_max']})"
        )
        lines.append(
            f"| {s['length']} | {s['side']} | {s['cache']} | {s['n']} | {_kib(s['kv_bytes'])} | "
            f"{100 * s['kv_bytes'] / ref:.0f}% | {_kib(s['kv_bytes_padded'])} | {_kib(s['kv_bytes_unmasked'])} | "
            f"{heads} | {fmt(s['accuracy'])} | {fmt(s['kld'], '.3g')} | {fmt(s['top1'])} |"
        )
    lines += [
        "",
        "**Paired differences** on the same trials (shared minus uniform; a CI that contains 0 is no measured "
        "difference):",
        "",
        "| length | cache | vs | n | ΔKL nats [95% CI] | Δtop-1 [95% CI] |",
        "|---:|---|---|---:|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p['length']} | {p['a']} | {p['b']} | {p['n']} | {fmt(p['d_kld'], '.3g')} | {fmt(p['d_top1'], '.3f')} |"
        )
    held = {(x["length"], x["cache"]): x["kv_bytes"] for x in summary}
    for length in sorted({x["length"] for x in summary}):
        kp = held.get((length, f"kvpress adakv_snapkv:{1 - args.keep:g}"))
        ours = [(c, b) for (n, c), b in held.items() if n == length and "heads=ada" in c]
        if kp and ours:
            lines += [
                "",
                f"**Memory at the same ratio ({length} tokens).** kvpress AdaKV holds {_kib(kp)} KiB; kvlab's ragged "
                + ", ".join(f"`{c}` {_kib(b)} KiB ({100 * b / kp:.0f}% of it)" for c, b in sorted(ours))
                + ".",
            ]
    lines += ["", *meta.get("notes", [])]
    write_page(path, "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from kvlab import load_model
    from kvlab.data import default_long_text
    from kvlab.eval.specs import parse_cache_specs
    from kvlab.model.loading import bundled_model_dir

    if args.report_only:
        saved = json.loads((args.out_dir / "result.json").read_text())
        run_args = parse_args(saved["meta"]["argv"])
        write_report(run_args, saved["summary"], saved["paired"], saved["meta"], args.results)
        print(args.results.read_text())
        return
    started, load_before = time.time(), os.getloadavg()
    specs = parse_cache_specs(spec_texts(args.keep))
    handle = load_model("smollm2-135m", device="cpu", dtype="float32")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    trials_file, job_path = out / "trials.jsonl", out / "job.json"
    worker_out, worker_log = out / "kvpress.jsonl", out / "kvpress.log"
    trials_file.write_text("")
    worker_out.unlink(missing_ok=True)
    job = {
        "kind": "ruler",
        "model_dir": str(bundled_model_dir()),
        "presses": list(PRESSES),
        "ratios": [round(1 - args.keep, 12)],
        "stop_ids": sorted(int(i) for i in handle.eos_ids()),
        "trials_file": str(trials_file),
        "threads": 1,
        "verify_first": True,
    }
    job_path.write_text(json.dumps(job, indent=1))
    proc, failure = None, ""
    if args.no_kvpress:
        failure = "kvpress skipped (--no-kvpress)"
    else:
        sys.path.insert(0, str(HERE / "anchors"))
        from run_anchors import start

        try:
            proc = start(job_path, worker_out, worker_log)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            failure = f"kvpress worker failed to start: {exc}"
    t0 = time.time()

    def progress(done: int, n: int) -> None:
        el = time.time() - t0
        print(f"kvlab: trial {done}/{n} ({el:.0f} s)", file=sys.stderr, flush=True)

    source = default_long_text()
    try:
        kv_rows, records = er.run_kvlab(
            handle,
            specs,
            tasks=args.task_list,
            lengths=args.length_list,
            trials=args.trials,
            seed=args.seed,
            trials_file=trials_file,
            haystack_text=source.text,
            logits_dir=out / "logits",
            progress=progress,
        )
    finally:
        er.end_job(trials_file)
    kv_s = time.time() - t0
    if proc is not None:
        try:
            rc = proc.wait(timeout=args.kvpress_timeout * 60)
            if rc:
                failure = f"kvpress worker exited with code {rc} (log: {worker_log})"
        except subprocess.TimeoutExpired:
            proc.kill()
            failure = f"kvpress worker stopped after {args.kvpress_timeout:.0f} minutes"
    worker_rows = er.read_jsonl(worker_out)
    kp_rows, failed = er.merge(handle, records, worker_rows)
    extra = {(w["task"], w["length"], w["trial"], w["setup"]): w for w in worker_rows if "setup" in w}
    checks = []
    for r in kp_rows:
        w = extra[(r["task"], r["length"], r["trial"], r["spec"].removeprefix("kvpress "))]
        for k in ("masked_slots", "kv_bytes_unmasked", "check_masked_keys_differ"):
            if k in w:
                r[k] = w[k]
        if "check_max_abs_diff_vs_standalone" in w:
            checks.append(
                f"{r['spec']}: max |diff| {w['check_max_abs_diff_vs_standalone']:.3g}"
                + (", masked keys DIFFER" if w.get("check_masked_keys_differ") else ", same masked keys")
            )
    rows = kv_rows + kp_rows
    summary = summarize(rows, args.seed)
    pairs_wanted = [
        (f"{s},keep={args.keep:g}{sh}", f"{s},keep={args.keep:g}") for s in SCORES for sh in SHARES[1:]
    ]
    r = f"{1 - args.keep:g}"
    pairs_wanted += [
        (f"kvpress adakv_snapkv:{r}", f"kvpress snapkv:{r}"),
        (f"kvpress pyramidkv:{r}", f"kvpress snapkv:{r}"),
    ]
    pairs = paired(rows, args.seed, pairs_wanted)
    agree = [
        w.get("top1_vs_kvlab_full")
        for w in worker_rows
        if w.get("setup") == "full" and "top1_vs_kvlab_full" in w
    ]
    notes = [
        "**Checks.** kvpress's shared prefill vs a standalone `with press(model)` prefill (first trial): "
        + ("; ".join(checks) or "not run")
        + ". "
        + (
            f"kvpress's full cache agrees with kvlab's full-cache argmax on {100 * _mean(agree):.1f}% of tokens "
            f"(the same model on both sides). "
            if agree
            else ""
        )
        + (f"kvpress: {failure}. " if failure else "")
        + (
            f"{len(failed)} kvpress rows failed: {sorted({f.get('error', '')[:120] for f in failed})}."
            if failed
            else ""
        ),
    ]
    meta = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": "SmolLM2-135M-Instruct",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, torch {torch.__version__}",
        "load_before": ", ".join(f"{x:.1f}" for x in load_before),
        "kvlab_seconds": kv_s,
        "wall": time.time() - started,
        "trials": len(args.task_list) * len(args.length_list) * args.trials,
        "notes": notes,
    }
    (out / "result.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "paired": pairs, "rows": rows}, default=str) + "\n"
    )
    write_report(args, summary, pairs, meta, args.results)
    print(args.results.read_text())


if __name__ == "__main__":
    main()
