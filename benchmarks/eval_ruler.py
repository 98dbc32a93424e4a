"""Benchmark: kvlab's RULER-style eval, kvlab's cache policies side by side with kvpress presses on the same ids.

One command, one run. kvlab's side is :func:`kvlab.eval.run.run_suite` (seeded trials from
:func:`kvlab.eval.tasks.make_trial` on the bundled SmolLM2-135M-Instruct; each trial prefilled once and
every policy reusing that prefill). While it runs, the ids it actually ran (context, question and the
full cache's greedy answer, handed over by run_suite's ``on_reference``, not re-derived) are appended trial by
trial to a JSONL job that the anchor worker (``benchmarks/anchors/anchor_worker.py``, job kind
``ruler``, kvpress 0.5.5 / transformers 5.2.0 in their own venv, one torch thread) consumes concurrently:
it prefills each context once with every press hooked in, asks the question uncompressed, returns greedy
answer ids and KL / top-1 against its own full cache on question + the full answer (teacher-forced, the
float64 formula of ``kvlab.metrics.divergence.token_kl``, computed in the worker). The answers are decoded
and scored here with kvlab's tokenizer and :func:`kvlab.eval.score.score`, and everything is summarised
with :func:`kvlab.eval.run.summarize` (bootstrap intervals from :func:`kvlab.metrics.stats.bootstrap_ci`).

Writes ``benchmarks/results/eval_ruler.md`` and ``benchmarks/results/eval_ruler.png``; raw rows under
``benchmarks/out/eval_ruler/``.

    python3 benchmarks/eval_ruler.py --trials 2                  # smoke run, all tasks at 1024
    python3 benchmarks/eval_ruler.py --trials 200 --lengths 1024,4096   # the issue's full run
    python3 benchmarks/eval_ruler.py --trials 200 --calibration benchmarks/results/ruler_calibration.json

With ``--calibration`` (``benchmarks/calibrate_ruler.py``'s JSON) each task runs at its calibrated knobs per
length, and the tasks the calibration marked apart are reported per task but left out of every pooled
figure (the pooled table, the figure, the ranking and the kvlab-vs-kvpress pairs).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Refusal, model_label, run_main  # noqa: E402

ROOT = HERE.parent
OUT = HERE / "out" / "eval_ruler"
RESULTS = HERE / "results" / "eval_ruler.md"
FIGURE = HERE / "results" / "eval_ruler.png"
POLICIES = ("window", "h2o", "snapkv", "tova", "knorm", "learned")
CODECS = ("int4", "int2")
PRESSES = ("snapkv", "knorm", "tova", "streaming_llm", "expected_attention")
#: kvlab policy -> the kvpress press that implements the same idea (one colour in the figure)
FAMILY = {
    "streaming_llm": "sinks+window",
    "snapkv": "SnapKV",
    "knorm": "key-norm",
    "tova": "TOVA",
    "h2o": "H2O",
    "learned": "learned",
    "expected_attention": "ExpectedAttention",
    "kvzip": "KVzip",
}
#: families whose two sides run the same method with different settings (said under the paired table)
SETTINGS_DIFFER = {
    "SnapKV": "kvlab's `snapkv` keeps a 32-slot window and observes the last 32 queries (SnapKV's reference "
    "code); kvpress's `SnapKVPress` defaults to `window_size=64` for both. The scoring is the same: with equal "
    "windows the two keep the same slots (`benchmarks/results/snapkv_vs_kvpress.md`)",
}


# -- kvlab's side: run_suite, recording the ids it runs ---------------------------------------------------


def _ids(tokens: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


def trial_record(cur: dict, index: int, logits_path: Path | None = None) -> dict:
    """One job line (what the worker needs) plus what the merge needs (answers, rule), checked for consistency."""
    trial = cur["trial"]
    missing = [k for k in ("context", "question", "answer", "forced") if k not in cur]
    if missing:
        raise RuntimeError(f"run_suite ran {trial.task} without the calls recorded: {missing} missing")
    if cur["start"] != len(cur["context"]):
        raise RuntimeError("the question did not start right after the context")
    if cur["forced"] != cur["question"] + cur["answer"][:-1]:
        raise RuntimeError("the teacher-forced ids are not question + the full answer minus its last token")
    rec = {
        "key": f"{trial.task}/{trial.length}/{index}",
        "task": trial.task,
        "length": trial.length,
        "trial": index,
        "seed": trial.seed,
        "context": cur["context"],
        "question": cur["question"],
        "answer": cur["answer"],
        "max_new_tokens": cur["max_new_tokens"],
        "kvlab_full_argmax": [int(i) for i in cur["full_logits"].argmax(-1).tolist()],
        "answers": list(trial.answers),
        "rule": trial.rule,
    }
    if logits_path is not None:
        torch.save(cur["full_logits"], logits_path)
        rec["kvlab_full_logits"] = str(logits_path)
    return rec


#: what the job lines leave out (kvlab-only: the worker never scores)
_KVLAB_ONLY = ("answers", "rule")


def run_kvlab(
    handle: Any,
    specs: Sequence[Any],
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    trials: int,
    seed: int,
    trials_file: Path,
    first_trial: int = 0,
    haystack_text: str | None = None,
    max_new_tokens: int | None = None,
    logits_dir: Path | None = None,
    progress: Any = None,
    knobs: Mapping[tuple[str, int], Mapping[str, int]] | None = None,
) -> tuple[list[dict], list[dict]]:
    """run_suite's rows, and one record per trial (appended to ``trials_file`` as each trial finishes).

    ``logits_dir``: where the full cache's logits of each (task, length)'s first trial are saved for the
    worker's cross-check (KL between the two sides' full caches).
    """
    from kvlab.eval.run import run_suite

    records: list[dict] = []
    counters: dict[tuple[str, int], int] = {}
    trials_file.parent.mkdir(parents=True, exist_ok=True)
    trials_file.write_text("")
    state: dict[str, Any] = {"current": None}

    def on_reference(reference: dict) -> None:  # run_trial's ids, answer and logits of the full cache
        state["current"] = reference

    def on_trial(done: int, total: int) -> None:
        cur = state["current"]
        trial = cur["trial"]
        index = counters.get((trial.task, trial.length), first_trial)
        counters[(trial.task, trial.length)] = index + 1
        path = None
        if logits_dir is not None and index == first_trial:
            logits_dir.mkdir(parents=True, exist_ok=True)
            path = logits_dir / f"{trial.task}-{trial.length}-full-logits.pt"
        rec = trial_record(cur, index, path)
        records.append(rec)
        with open(trials_file, "a") as f:
            f.write(json.dumps({k: v for k, v in rec.items() if k not in _KVLAB_ONLY}) + "\n")
        state["current"] = None
        if progress is not None:
            progress(done, total)

    rows = run_suite(
        handle,
        specs,
        tasks=tasks,
        lengths=lengths,
        trials=trials,
        seed=seed,
        first_trial=first_trial,
        haystack_text=haystack_text,
        max_new_tokens=max_new_tokens,
        progress=on_trial,
        on_reference=on_reference,
        knobs=knobs,
    )
    # the recorded full answer is the one run_suite scored
    stop = handle.eos_ids()
    by_key = {(r["task"], r["length"], r["trial"]): r for r in records}
    for row in rows:
        if row["kind"] == "full":
            rec = by_key[(row["task"], row["length"], row["trial"])]
            if handle.decode(until_stop(rec["answer"], stop)) != row["output"]:
                raise RuntimeError(f"recorded full answer differs from run_suite's for {rec['key']}")
    for row in rows:
        row["side"] = "kvlab"
    return rows, records


def end_job(trials_file: Path) -> None:
    with open(trials_file, "a") as f:
        f.write(json.dumps({"end": True}) + "\n")


def until_stop(tokens: Sequence[int], stop: set[int]) -> list[int]:
    """The answer up to (not including) its first stop id, as kvlab's run_trial cuts it."""
    out = []
    for t in tokens:
        if int(t) in stop:
            break
        out.append(int(t))
    return out


# -- merging the worker's rows: decoded and scored in kvlab's process ----------------------------------


#: the worker's fields a merged row keeps as they are (checks; what a masking press keeps; KVzip's prefix)
_PASSED = ("check_", "top1_vs_", "kl_kvlab", "batch_rows", "kvzip_", "kept_per", "masked")


def merge(handle: Any, records: Sequence[dict], worker_rows: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """The worker's rows as kvlab-style rows (``side: kvpress``), answers decoded with kvlab's tokenizer and
    scored with :func:`kvlab.eval.score.score`; and the rows that failed (with their error)."""
    from kvlab.eval.score import score

    by_key = {r["key"]: r for r in records}
    stop = handle.eos_ids()
    rows, failed = [], []
    for w in worker_rows:
        if w.get("meta") or w.get("done"):
            continue
        if "error" in w:
            failed.append(w)
            continue
        rec = by_key[w["key"]]
        text = handle.decode(until_stop(w["answer_ids"], stop))
        full = w["press"] is None
        rows.append(
            {
                "side": "kvpress",
                "spec": f"kvpress {w['setup']}",
                "kind": "full" if full else "evict",
                "policy": w["press"],
                "compression_ratio": w["ratio"],
                "task": w["task"],
                "length": w["length"],
                "trial": w["trial"],
                "seed": w["seed"],
                "kept_slots": w["kept_slots"],
                "kv_bytes": w["kv_bytes"],
                "output": text,
                "answers": rec["answers"],
                "rule": rec["rule"],
                "score": score(text, rec["answers"], rec["rule"]),
                "kld": w["kld"],
                "top1": w["top1"],
                "kld_answer": w["kld_answer"],
                "top1_answer": w["top1_answer"],
                "compared_tokens": w["compared_tokens"],
                "prefill_s": w["prefill_s"],
                "seconds": w["seconds"],
                **{k: w[k] for k in w if k.startswith(_PASSED)},
            }
        )
    return rows, failed


def _gz(path: Path) -> Path:
    return path.with_name(path.name + ".gz")


def read_text(path: Path) -> str:
    """``path``'s text, or its gzipped copy's (``path.gz``, as :func:`archive` writes it)."""
    if not path.exists() and _gz(path).exists():
        return gzip.decompress(_gz(path).read_bytes()).decode()
    return path.read_text()


def exists(path: Path) -> bool:
    return path.exists() or _gz(path).exists()


def archive(run: Path, dest: Path) -> list[Path]:
    """Keep a run's raw rows where a checkout keeps them: gzipped copies of ``run``'s ``kvlab.json`` (every
    row and trial record), ``job.json`` and ``kvpress.jsonl`` (the worker's rows) in ``dest``. ``dest`` is a
    piece like any other: ``--merge dest new_piece ...`` extends the run (benchmarks/out/ is not kept)."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("kvlab.json", "job.json", "kvpress.jsonl"):
        if exists(run / name):
            data = read_text(run / name).encode()
            _gz(dest / name).write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
            written.append(_gz(dest / name))
    return written


def read_jsonl(path: Path) -> list[dict]:
    if not exists(path):
        return []
    out = []
    for line in read_text(path).splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line the worker was writing when it stopped
                break
    return out


# -- reporting -----------------------------------------------------------------------------------------


def _fmt(iv: dict | None, digits: str = ".2f") -> str:
    if iv is None:
        return "—"
    if iv["low"] is None or (isinstance(iv["low"], float) and math.isnan(iv["low"])):
        return (
            f"{iv['value']:{digits}} (n = {iv['n']}, no interval)" if "n" in iv else f"{iv['value']:{digits}}"
        )
    return f"{iv['value']:{digits}} [{iv['low']:{digits}}, {iv['high']:{digits}}]"


def _cache_key(row: dict) -> tuple[str, str, float]:
    """(side, name, ratio) for ordering and plotting: name is the policy / press / codec / ``full``."""
    side = row.get("side", "kvlab")
    if row["kind"] == "full":
        return side, "full", 0.0
    if row["kind"] == "quant":
        return side, row["spec"], float("nan")
    return side, row["policy"], float(row["compression_ratio"])


def summary_rows(rows: Sequence[dict], seed: int) -> list[dict]:
    """kvlab's summarize (per task, cache, length), with each group's side / name / ratio attached."""
    from kvlab.eval.run import summarize

    first: dict[tuple, dict] = {}
    for r in rows:
        first.setdefault((r["task"], r["spec"], r["length"]), r)
    out = []
    for s in summarize(rows, seed=seed):
        side, name, ratio = _cache_key(first[(s["task"], s["cache"], s["length"])])
        out.append({**s, "side": side, "name": name, "ratio": ratio})
    return out


def _order(s: dict) -> tuple:
    ratio = -1.0 if s["name"] == "full" else (2.0 if math.isnan(s["ratio"]) else s["ratio"])
    return (s.get("task", ""), s["length"], ratio, s["side"] != "kvlab", s["name"])


def table_lines(summary: Sequence[dict]) -> list[str]:
    lines = [
        "| task | length | ratio | side | cache | n | accuracy [95% CI] | KL nats [95% CI] | top-1 [95% CI] |",
        "|---|---:|---:|---|---|---:|---|---|---|",
    ]
    for s in sorted(summary, key=_order):
        ratio = "—" if math.isnan(s["ratio"]) else f"{s['ratio']:g}"
        inf = f" ({s['kld_infinite']} inf)" if s.get("kld_infinite") else ""
        lines.append(
            f"| {s['task']} | {s['length']} | {ratio} | {s['side']} | {s['name']} | {s['trials']} | "
            f"{_fmt(s['accuracy'])} | {_fmt(s['kld'], '.3g')}{inf} | {_fmt(s['top1'])} |"
        )
    return lines


def pooled(rows: Sequence[dict], seed: int) -> list[dict]:
    """Accuracy / KL / top-1 per (side, cache, length) pooled over tasks (one sample per task trial), with the
    eval's own intervals (:func:`kvlab.eval.run.interval`: Wilson for accuracy)."""
    from kvlab.eval.run import interval

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        side, name, ratio = _cache_key(r)
        groups.setdefault((side, name, ratio if not math.isnan(ratio) else -9.0, r["length"]), []).append(r)
    out = []
    for (side, name, ratio, length), rs in groups.items():

        def iv(key: str, rs=rs) -> dict | None:
            vals = [r[key] for r in rs if r[key] is not None and math.isfinite(r[key])]
            return interval(vals, seed, share=key == "score")

        out.append(
            {
                "side": side,
                "name": name,
                "ratio": float("nan") if ratio == -9.0 else ratio,
                "length": length,
                "trials": len(rs),
                "accuracy": iv("score"),
                "kld": iv("kld"),
                "top1": iv("top1"),
            }
        )
    return out


def _paired(a: dict, b: dict, seed: int) -> tuple[dict | None, str]:
    """Mean of a − b over the trials both have (scores in [0, 1]), its paired interval (Tango's score interval,
    :func:`kvlab.metrics.stats.paired_share_ci`: not degenerate when every pair ties), and what it says."""
    from kvlab.metrics.stats import paired_share_ci

    keys = sorted(set(a) & set(b))
    if not keys:
        return None, "no common trials"
    iv = paired_share_ci([a[k] for k in keys], [b[k] for k in keys]).to_json()
    if iv["low"] is None:
        return iv, f"n = {len(keys)}, no interval"
    return iv, "lower" if iv["high"] < 0 else "higher" if iv["low"] > 0 else "no difference seen"


def ranking_lines(rows: Sequence[dict], seed: int) -> list[str]:
    """Each side's caches per length ranked by pooled accuracy, as paired differences over the same trials: to
    that side's full cache and to the cache ranked just above, each with its interval and the verdict it gives."""
    by: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        side, name, ratio = _cache_key(r)
        label = name if name == "full" or math.isnan(ratio) else f"{name} @ {ratio:g}"
        by.setdefault((side, r["length"]), {}).setdefault(label, {})[(r["task"], r["trial"])] = r["score"]
    lines = [
        "| length | side | rank | cache | n | accuracy | Δ to full [95% CI] | verdict | Δ to the one above [95% CI] | verdict |",
        "|---:|---|---:|---|---:|---:|---|---|---|---|",
    ]
    for (side, length), caches in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0] != "kvlab")):
        ranked = sorted(caches.items(), key=lambda kv: (-sum(kv[1].values()) / len(kv[1]), kv[0]))
        full = caches.get("full", {})
        for rank, (label, scores) in enumerate(ranked, 1):
            to_full, says_full = _paired(scores, full, seed) if label != "full" else (None, "—")
            to_above, says_above = _paired(scores, ranked[rank - 2][1], seed) if rank > 1 else (None, "—")
            lines.append(
                f"| {length} | {side} | {rank} | {label} | {len(scores)} | {sum(scores.values()) / len(scores):.2f} | "
                f"{_fmt(to_full, '+.3f')} | {says_full} | {_fmt(to_above, '+.3f')} | {says_above} |"
            )
    return lines


def pooled_lines(pool: Sequence[dict]) -> list[str]:
    lines = [
        "| length | ratio | side | cache | n | accuracy [95% CI] | KL nats [95% CI] | top-1 [95% CI] |",
        "|---:|---:|---|---|---:|---|---|---|",
    ]
    for s in sorted(pool, key=lambda s: (s["length"], *_order(s)[2:])):
        ratio = "—" if math.isnan(s["ratio"]) else f"{s['ratio']:g}"
        lines.append(
            f"| {s['length']} | {ratio} | {s['side']} | {s['name']} | {s['trials']} | {_fmt(s['accuracy'])} | "
            f"{_fmt(s['kld'], '.3g')} | {_fmt(s['top1'])} |"
        )
    return lines


def figure(pool: Sequence[dict], path: Path, title: str) -> None:
    """Accuracy (pooled over tasks) vs ratio per policy: kvlab solid, kvpress dashed, one panel per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({s["length"] for s in pool})
    fig, axes = plt.subplots(1, len(lengths), figsize=(7.5 * len(lengths), 5.2), squeeze=False)
    colours = {fam: f"C{i}" for i, fam in enumerate(FAMILY.values())}
    for ax, length in zip(axes[0], lengths, strict=True):
        at = [s for s in pool if s["length"] == length and s["accuracy"] is not None]
        curves: dict[tuple[str, str], list[dict]] = {}
        for s in at:
            if s["name"] == "full" or math.isnan(s["ratio"]):
                continue
            curves.setdefault((s["side"], s["name"]), []).append(s)
        for (side, name), pts in sorted(curves.items()):
            pts.sort(key=lambda s: s["ratio"])
            x = [p["ratio"] for p in pts]
            y = [p["accuracy"]["value"] for p in pts]
            lo = [
                p["accuracy"]["value"]
                - (p["accuracy"]["low"] if _ok(p["accuracy"]["low"]) else p["accuracy"]["value"])
                for p in pts
            ]
            hi = [
                (p["accuracy"]["high"] if _ok(p["accuracy"]["high"]) else p["accuracy"]["value"])
                - p["accuracy"]["value"]
                for p in pts
            ]
            fam = FAMILY.get(name, name)
            ax.errorbar(
                [v + (0.006 if side == "kvpress" else -0.006) for v in x],
                y,
                yerr=[lo, hi],
                color=colours.get(fam),
                linestyle="-" if side == "kvlab" else "--",
                marker="o" if side == "kvlab" else "s",
                capsize=3,
                linewidth=1.6,
                label=f"{side} {fam}",
            )
        for s in at:
            if s["name"] == "full":
                ax.axhline(
                    s["accuracy"]["value"],
                    color="black",
                    linestyle="-" if s["side"] == "kvlab" else "--",
                    linewidth=1.0,
                    label=f"{s['side']} full cache",
                )
            elif math.isnan(s["ratio"]):
                ax.axhline(
                    s["accuracy"]["value"],
                    color="grey",
                    linestyle=":" if "2" in s["name"] else "-.",
                    linewidth=1.2,
                    label=f"kvlab {s['name']} (no eviction)",
                )
        n = max((s["trials"] for s in at), default=0)
        ax.set_title(f"{length} tokens ({n} task-trials per point)")
        ax.set_xlabel("compression ratio (fraction of the context removed)")
        ax.set_ylabel("accuracy, all tasks pooled (Wilson 95% CI)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _ok(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


# -- the run -------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _device_name(device: str) -> str:
    """The device as the report names it: the card's name on CUDA."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"CUDA ({device}; the card was not recorded)"
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return f"CUDA ({torch.cuda.get_device_name(torch.device(device if device != 'auto' else 'cuda'))})"
    return "CPU"


def machine_facts(device: str) -> dict:
    """Where kvlab's side ran, recorded with the run (kvlab.json): a report written later, or on another
    machine from pieces run elsewhere (--report-only --merge), describes the machine that ran them."""
    import transformers

    return {
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "device": _device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def haystack_facts(source: Any) -> dict:
    """The haystack a run used, recorded with it: a report merged later, in a process whose default text
    differs (no ../shared beside it), still names the text the trials were built from."""
    import hashlib

    digest = hashlib.sha256(source.text.encode()).hexdigest()[:16]
    return {"source": source.source, "sha256": digest, "chars": len(source.text)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from kvlab.eval.tasks import TASKS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2, help="trials per task and length")
    ap.add_argument("--lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--tasks", default=",".join(TASKS), help="tasks, comma-separated")
    ap.add_argument("--ratios", default="0.25,0.5,0.75", help="fractions of the context removed")
    ap.add_argument("--policies", default=",".join(POLICIES), help="kvlab eviction policies")
    ap.add_argument(
        "--codecs", default=",".join(CODECS), help="kvlab quantizer specs (int4, int2, kivi:int2 ...)"
    )
    ap.add_argument("--presses", default=",".join(PRESSES), help="kvpress presses (worker names)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--first-trial",
        type=int,
        default=0,
        help="index of the first trial (a piece of a longer run: pieces together equal one run)",
    )
    ap.add_argument("--haystack", type=Path, help="a text file to hide the facts in (default: kvlab's)")
    ap.add_argument("--max-new-tokens", type=int, help="answer budget (default: each task's own)")
    ap.add_argument("--no-kvpress", action="store_true", help="kvlab's side only")
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (bundled), gemma3-270m (the optional package; kvpress cannot run it: --no-kvpress) "
        "or a local folder; both sides",
    )
    ap.add_argument("--device", default="cpu", help="where kvlab's side runs: cpu, cuda, cuda:N, auto")
    ap.add_argument("--dtype", default="float32", help="kvlab's model dtype: float32, bfloat16, float16")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of kvlab's side (1 beside the worker; all cores alone)",
    )
    ap.add_argument(
        "--kvpress-timeout", type=float, default=90, help="minutes to wait for the worker after kvlab"
    )
    ap.add_argument("--out-dir", type=Path, default=OUT)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--no-verify", action="store_true", help="skip the worker's check of its shared prefill")
    ap.add_argument(
        "--no-logits",
        action="store_true",
        help="don't save the full cache's logits of the piece's first trials (the worker's check needs them;"
        " ~0.8 GB per task at 4k)",
    )
    ap.add_argument("--report-only", action="store_true", help="re-merge and re-report the run in --out-dir")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="with --report-only: the out-dirs of pieces of one run (--first-trial) to report as one",
    )
    ap.add_argument(
        "--archive",
        type=Path,
        help="with --report-only: also write the run's raw rows, gzipped, into this folder (a piece for"
        " later --merge; keep it in benchmarks/results/raw/)",
    )
    ap.add_argument(
        "--raw",
        type=Path,
        help="with --report-only: the folder of raw rows the report names (e.g. benchmarks/results/raw/X)",
    )
    ap.add_argument(
        "--calibration",
        type=Path,
        help="a calibration (benchmarks/calibrate_ruler.py's JSON): each task at its calibrated knobs; the tasks"
        " it marks apart are left out of the pooled figures",
    )
    ap.add_argument(
        "--timing-runs",
        type=Path,
        nargs="*",
        help="result.json of other runs whose per-trial time feeds the estimate",
    )
    args = ap.parse_args(argv)
    args.length_list = [int(v) for v in _csv(args.lengths)]
    args.task_list = _csv(args.tasks)
    args.ratio_list = [float(v) for v in _csv(args.ratios)]
    unknown = [t for t in args.task_list if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    return args


def calibration_of(
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, int], dict[str, int]], set[tuple[str, int]]]:
    """From ``--calibration``: the knobs of each (task, length) the run asks for and those marked apart
    (none without it); refused when the run's seeds are calibration seeds or the file lacks a pair."""
    if getattr(args, "calibration", None) is None:
        return {}, set()
    from kvlab.errors import BadInputError
    from kvlab.eval.calibrate import Calibration
    from kvlab.eval.tasks import trial_seed

    want = [(t, n) for t in args.task_list for n in args.length_list]
    try:
        cal = Calibration.read(args.calibration)
        cal.check_model(args.model)
        cal.check_seeds(
            trial_seed(args.seed, i) for i in range(args.first_trial, args.first_trial + args.trials)
        )
        return {k: cal.knobs(*k) for k in want}, cal.apart() & set(want)
    except BadInputError as exc:
        raise Refusal(f"--calibration {args.calibration}: {exc}") from None


def calibration_lines(cal: Mapping) -> list[str]:
    """The report's line on the tasks' knobs: calibrated (which, and which tasks are apart) or the defaults."""
    if not cal["file"]:
        return ["- tasks at their default knobs (no --calibration)"]
    path = Path(cal["file"]).resolve()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    knobs = "; ".join(
        f"{k['task']} @ {k['length']}: " + (", ".join(f"{a}={v}" for a, v in k["knobs"].items()) or "default")
        for k in cal["knobs"]
    )
    apart = ", ".join(f"{t} @ {n}" for t, n in cal["apart"]) or "none"
    return [
        f"- calibrated: each task at its knobs from `{name}` ({knobs}); apart (reached no setting in the "
        f"band; in the per-task table only, in no pooled figure): {apart}"
    ]


def pooled_rows(rows: Sequence[dict], apart: set[tuple[str, int]]) -> list[dict]:
    """The rows a pooled figure counts: none of a (task, length) the calibration marked apart."""
    return [r for r in rows if (r["task"], r["length"]) not in apart]


def cache_specs(args: argparse.Namespace) -> list[Any]:
    from kvlab.eval.specs import parse_cache_specs

    evictions = [f"{p}:{r:g}" for p in _csv(args.policies) for r in args.ratio_list]
    return parse_cache_specs(["full", *evictions, *_csv(args.codecs)])


def kvpress_cannot_run(config: Mapping) -> str | None:
    """Why kvpress cannot run a model (its ``config.json``), or None. kvpress 0.5.5 skips the sliding layers
    of ``Gemma3ForConditionalGeneration`` only: on a text-only Gemma-3 it compresses them too, and the next
    forward fails (``benchmarks/anchors/kvpress_gemma3_check.py``)."""
    text = config.get("text_config") or config
    sliding = "sliding_attention" in (text.get("layer_types") or [])
    if text.get("model_type") == "gemma3_text" and sliding and "text_config" not in config:
        return (
            "kvpress 0.5.5 does not run a text-only Gemma-3: it compresses the sliding layers, and the next "
            "forward fails (benchmarks/anchors/kvpress_gemma3_check.py); give --no-kvpress"
        )
    return None


def kvpress_refusal(model: str) -> str | None:
    """:func:`kvpress_cannot_run` for ``--model``, converting nothing: a local folder's ``config.json``, or
    for the bundled aliases what they are (Gemma-3-270M is a text-only Gemma-3, SmolLM2 a Llama)."""
    from kvlab.model.loading import GEMMA_ALIASES, local_model_dir

    folder = local_model_dir(model)
    if folder is not None:
        return kvpress_cannot_run(json.loads((folder / "config.json").read_text()))
    gemma = {"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"]}
    return kvpress_cannot_run(gemma) if model.lower() in GEMMA_ALIASES else None


def worker_job(args: argparse.Namespace, handle: Any, trials_file: Path) -> dict:
    from kvlab.model.loading import resolve_model_dir

    return {
        "kind": "ruler",
        "model_dir": str(resolve_model_dir(args.model)[0]),
        "presses": _csv(args.presses),
        "ratios": args.ratio_list,
        "stop_ids": sorted(int(i) for i in handle.eos_ids()),
        "trials_file": str(trials_file),
        "threads": 1,  # the worker's
        "verify_first": not args.no_verify,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    from kvlab import load_model
    from kvlab.data import default_long_text, read_text_file

    started = time.time()
    load_before = os.getloadavg()
    specs = cache_specs(args)
    knobs, _ = calibration_of(args)
    source = read_text_file(args.haystack) if args.haystack else default_long_text()
    if not args.no_kvpress and args.device != "cpu":
        raise Refusal("the kvpress worker runs on the CPU beside kvlab: give --no-kvpress with --device")
    if (args.merge or args.archive) and not args.report_only:
        raise Refusal("--merge and --archive report pieces that ran: give them with --report-only")
    if not (args.no_kvpress or args.report_only) and (why := kvpress_refusal(args.model)) is not None:
        raise Refusal(f"--model {args.model}: {why}")
    if args.archive and args.archive.exists() and not args.archive.is_dir():
        raise Refusal(f"--archive {args.archive}: a file is there; give a folder")
    # a report of pieces run elsewhere needs only the tokenizer: the model on the CPU
    handle = load_model(args.model, device="cpu" if args.report_only else args.device, dtype=args.dtype)
    out = args.out_dir
    if args.report_only:  # merge what an earlier run of the same arguments left in --out-dir
        if args.merge:
            pieces(args.merge, out)
        if args.archive:
            for path in archive(out, args.archive):
                print(f"raw rows: {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
        saved = json.loads(read_text(out / "kvlab.json"))
        job = json.loads(read_text(out / "job.json"))
        if (
            saved.get("argv") is not None
        ):  # the run's own arguments; the report's outputs and timings from now
            run_args = parse_args(saved["argv"])
            if run_args.model != args.model:
                raise Refusal(
                    f"the run in {out} is of --model {run_args.model}: give that model to report it"
                )
            run_args.results, run_args.figure = args.results, args.figure
            run_args.timing_runs, run_args.out_dir = args.timing_runs, args.out_dir
            run_args.raw = args.raw
            args, specs = run_args, cache_specs(run_args)
        args._machine = saved.get("machine")
        args._haystack = saved.get("haystack") or {
            "source": "not recorded by the run (a piece older than the field)"
        }
        args._handle = handle
        args._pieces = saved.get("pieces")
        args._worker_afterwards = saved.get("worker_afterwards", True)  # merges older than the field
        return finish(
            args,
            specs,
            job,
            source,
            out,
            saved["rows"],
            saved["records"],
            saved["kvlab_seconds"],
            saved["started"],
            saved["load_before"],
            "",
            saved.get("argv", argv),
            wall=saved.get("wall"),
        )
    out.mkdir(parents=True, exist_ok=True)
    trials_file, job_path = out / "trials.jsonl", out / "job.json"
    worker_out, worker_log = out / "kvpress.jsonl", out / "kvpress.log"
    trials_file.write_text("")
    worker_out.unlink(missing_ok=True)
    proc, failure = None, ""
    job = worker_job(args, handle, trials_file)
    job_path.write_text(json.dumps(job, indent=1))
    if args.no_kvpress:
        failure = "kvpress skipped (--no-kvpress)"
    else:
        sys.path.insert(0, str(HERE / "anchors"))
        from run_anchors import start

        try:
            proc = start(job_path, worker_out, worker_log)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            failure = f"kvpress worker failed to start: {exc}"
    t_kv = time.time()

    def progress(done: int, n: int) -> None:
        el = time.time() - t_kv
        print(f"kvlab: trial {done}/{n} ({el:.0f} s, {el / done:.1f} s/trial)", file=sys.stderr, flush=True)

    try:
        kv_rows, records = run_kvlab(
            handle,
            specs,
            tasks=args.task_list,
            lengths=args.length_list,
            trials=args.trials,
            seed=args.seed,
            first_trial=args.first_trial,
            trials_file=trials_file,
            haystack_text=source.text,
            max_new_tokens=args.max_new_tokens,
            logits_dir=None if args.no_logits else out / "logits",
            progress=progress,
            knobs=knobs,
        )
    except BaseException:
        end_job(trials_file)
        if proc is not None:
            proc.kill()
        raise
    end_job(trials_file)
    kv_s = time.time() - t_kv
    (out / "kvlab.json").write_text(  # kvlab's part on its own, for --report-only
        json.dumps(
            {
                "rows": kv_rows,
                "records": records,
                "kvlab_seconds": kv_s,
                "started": started,
                "load_before": load_before,
                "argv": list(sys.argv[1:] if argv is None else argv),
                "machine": machine_facts(args.device),
                "haystack": haystack_facts(source),
            }
        )
        + "\n"
    )
    if proc is not None:
        try:
            rc = proc.wait(timeout=args.kvpress_timeout * 60)
            if rc:
                failure = f"kvpress worker exited with code {rc} (log: {worker_log})"
        except subprocess.TimeoutExpired:
            proc.kill()
            failure = f"kvpress worker stopped after the {args.kvpress_timeout:.0f}-minute timeout"
    args._handle = handle
    finish(args, specs, job, source, out, kv_rows, records, kv_s, started, load_before, failure, argv)


_PIECE_ARGS = (  # what may differ between pieces of one run (none changes a row)
    "first_trial",
    "trials",
    "out_dir",
    "results",
    "figure",
    "timing_runs",
    "merge",
    "archive",
    "report_only",
    "no_logits",
    "no_verify",  # the worker's check of its shared prefill on a piece's first trial: a check, not a row
    # where a piece ran (recorded with it, and named per piece in the merged report) and the haystack's
    # path (its text is checked by sha256 below): pieces of one run may come from a GPU and this CPU
    "device",
    "threads",
    "haystack",
)


def _merged_machine(saved: Sequence[dict], runs: Sequence[dict]) -> dict | None:
    """The machine of a merged run: the pieces' own when they all ran on one, else one record naming each
    device (with its torch threads) and how many trials per task ran there."""
    machines = [s.get("machine") for s in saved]
    if all(m == machines[0] for m in machines) or any(m is None for m in machines):
        return machines[0]
    where: dict[str, int] = {}
    for m, r in zip(machines, runs, strict=True):
        assert m is not None  # checked above
        key = f"{m['device']} ({m['cpus']} CPU cores, {r['threads']} torch thread(s))"
        where[key] = where.get(key, 0) + int(r["trials"])

    def joined(field: str) -> str:
        return " / ".join(dict.fromkeys(str(m.get(field, "?")) for m in machines if m is not None))

    return {
        "arch": joined("arch"),
        "cpus": joined("cpus"),
        "device": "; ".join(f"{k} for {n} trials per task" for k, n in where.items()),
        "torch": joined("torch"),
        "transformers": joined("transformers"),
        "mixed": True,
    }


def pieces(dirs: Sequence[Path], out: Path) -> None:
    """Write into ``out`` one run made of the pieces in ``dirs`` (each a run with its own ``--first-trial``):
    the same arguments apart from the trial range, no trial twice; rows, records and the worker's lines
    concatenated, seconds summed. The merged run's arguments say ``--trials`` = the trials per task in all."""
    saved = [json.loads(read_text(d / "kvlab.json")) for d in dirs]
    runs = [vars(parse_args(s["argv"])) for s in saved]
    same = [{k: v for k, v in r.items() if k not in _PIECE_ARGS} for r in runs]
    if any(s != same[0] for s in same):
        raise Refusal("--merge: the pieces ran with different arguments (beyond --first-trial/--trials)")
    if len({(s.get("haystack") or {}).get("sha256") for s in saved}) > 1:  # the text, not a note beside it
        raise Refusal("--merge: the pieces ran over different haystacks")
    records = [rec for s in saved for rec in s["records"]]
    keys = [rec["key"] for rec in records]
    if len(set(keys)) != len(keys):
        raise Refusal("--merge: the pieces overlap (a trial ran twice)")
    per_task = sum(r["trials"] for r in runs)
    argv = [a for a in saved[0]["argv"]]
    i = argv.index("--trials") if "--trials" in argv else -1
    argv = argv[:i] + argv[i + 2 :] if i >= 0 else argv
    i = argv.index("--first-trial") if "--first-trial" in argv else -1
    argv = argv[:i] + argv[i + 2 :] if i >= 0 else argv
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": [row for s in saved for row in s["rows"]],
        "records": records,
        "kvlab_seconds": sum(s["kvlab_seconds"] for s in saved),
        "started": min(s["started"] for s in saved),
        "load_before": saved[0]["load_before"],
        "machine": _merged_machine(saved, runs),
        "haystack": saved[0].get("haystack"),
        "argv": [*argv, "--trials", str(per_task)],
        "wall": sum(s.get("wall") or s["kvlab_seconds"] for s in saved),
        "pieces": [
            {"dir": str(d), "first_trial": r["first_trial"], "trials": r["trials"]}
            for d, r in zip(dirs, runs, strict=True)
        ],
    }
    (out / "kvlab.json").write_text(json.dumps(doc) + "\n")
    (out / "job.json").write_text(read_text(dirs[0] / "job.json"))
    # the worker's lines (run beside a piece, or later on its trials: run_anchors.py DIR/job.json
    # DIR/kvpress.jsonl): one meta line, every row, one done line only if every piece's worker finished
    worker = [read_jsonl(d / "kvpress.jsonl") for d in dirs]
    metas = [w for lines in worker for w in lines if w.get("meta")]
    dones = [next((w for w in lines if w.get("done")), None) for lines in worker]
    rows = [w for lines in worker for w in lines if not w.get("meta") and not w.get("done")]
    merged = [*metas[:1], *rows]
    if rows and all(dones):
        merged.append(
            {
                "done": True,
                "trials": sum(d["trials"] for d in dones),
                "seconds": sum(d["seconds"] for d in dones),
            }
        )
    # where the worker ran: beside each piece, or afterwards on the ids kvlab's pieces recorded
    doc["worker_afterwards"] = bool(rows) and "--no-kvpress" in doc["argv"]
    (out / "kvlab.json").write_text(json.dumps(doc) + "\n")
    if rows and "--no-kvpress" in doc["argv"]:  # the pieces ran kvlab's side; the worker ran on their ids
        doc["argv"] = [a for a in doc["argv"] if a != "--no-kvpress"]
        (out / "kvlab.json").write_text(json.dumps(doc) + "\n")
    (out / "kvpress.jsonl").write_text("".join(json.dumps(w) + "\n" for w in merged))


def finish(
    args, specs, job, source, out, kv_rows, records, kv_s, started, load_before, failure, argv, wall=None
) -> None:
    """Merge the worker's rows, summarise, write result.json, the report and the figure."""
    worker_out = out / "kvpress.jsonl"
    worker_rows = read_jsonl(worker_out)
    meta = next((w for w in worker_rows if w.get("meta")), None)
    done = next((w for w in worker_rows if w.get("done")), None)
    handle = args._handle
    kp_rows, failed = merge(handle, records, worker_rows)
    if wall is None:
        wall = time.time() - started
        saved = out / "kvlab.json"
        doc0 = json.loads(saved.read_text())
        saved.write_text(json.dumps({**doc0, "wall": wall}) + "\n")
    if done is None and not failure and not args.no_kvpress:
        failure = "the kvpress worker did not finish (its rows so far are merged)"
    rows = kv_rows + kp_rows
    summary = summary_rows(rows, args.seed)
    knobs, apart = calibration_of(args)
    pool = pooled(pooled_rows(rows, apart), args.seed)
    doc = {
        "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")
        },
        "specs": [s.to_json() for s in specs],
        "job": job,
        "worker_meta": meta,
        "worker_done": done,
        "started": started,
        "worker_failed_rows": failed,
        "failure": failure,
        "wall_seconds": wall,
        "kvlab_seconds": kv_s,
        "n_trials": len(records),
        "calibration": {
            "file": str(args.calibration) if args.calibration else None,
            "knobs": [{"task": t, "length": n, "knobs": k} for (t, n), k in sorted(knobs.items())],
            "apart": sorted(apart),
        },
        # wall seconds per trial (the slower side; both run concurrently), only when one length ran
        "per_trial_by_length": (
            {str(args.length_list[0]): max(kv_s, done["seconds"] if done else 0.0) / len(records)}
            if len(args.length_list) == 1 and records and (done or args.no_kvpress)
            else {}
        ),
        "summary": summary,
        "pooled": pool,
        "rows": rows,
    }
    (out / "result.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    write_report(args, doc, records, source, load_before, argv)


def paired_lines(rows: Sequence[dict], seed: int) -> list[str]:
    """kvlab policy vs the kvpress press of the same family at the same ratio, paired on the same trials."""
    from kvlab.metrics.stats import paired_share_ci

    by: dict[tuple, dict] = {}
    for r in rows:
        if r["kind"] != "evict":
            continue
        by.setdefault((r["side"], r["policy"], float(r["compression_ratio"])), {})[
            (r["task"], r["length"], r["trial"])
        ] = r
    shown: set[str] = set()
    lines = [
        "| family | ratio | trials | accuracy kvlab − kvpress [95% CI] | same answer | mean KL kvlab / kvpress | mean abs(ΔKL) |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    for (side, policy, ratio), kv in sorted(by.items(), key=lambda kv: (FAMILY.get(kv[0][1], ""), kv[0][2])):
        if side != "kvlab":
            continue
        press = next((p for p in (*PRESSES, "kvzip") if FAMILY.get(p) == FAMILY.get(policy)), None)
        kp = by.get(("kvpress", press, ratio), {})
        keys = sorted(set(kv) & set(kp))
        if not keys:
            continue
        iv = paired_share_ci([kv[k]["score"] for k in keys], [kp[k]["score"] for k in keys]).to_json()
        same = sum(kv[k]["output"] == kp[k]["output"] for k in keys)
        fin = [k for k in keys if math.isfinite(kv[k]["kld"]) and math.isfinite(kp[k]["kld"])]
        mk = sum(kv[k]["kld"] for k in fin) / max(len(fin), 1)
        mp = sum(kp[k]["kld"] for k in fin) / max(len(fin), 1)
        dk = sum(abs(kv[k]["kld"] - kp[k]["kld"]) for k in fin) / max(len(fin), 1)
        shown.add(FAMILY.get(policy, policy))
        lines.append(
            f"| {FAMILY.get(policy, policy)} | {ratio:g} | {len(keys)} | {_fmt(iv, '+.2f')} | {same}/{len(keys)} | "
            f"{mk:.3g} / {mp:.3g} | {dk:.2g} |"
        )
    notes = [f"- {fam}: {why}." for fam, why in SETTINGS_DIFFER.items() if fam in shown]
    return lines + ([""] + notes if notes else [])


def trial_seconds(rows: Sequence[dict]) -> dict[tuple[str, str, int], float]:
    """Median seconds one trial costs each side, per (side, task, length): its prefill plus every cache's
    answer and teacher-forced pass (from the rows' own timers; the median keeps the worker's first,
    checked, trial out)."""
    import statistics

    per: dict[tuple, dict[int, float]] = {}
    for r in rows:
        key = (r["side"], r["task"], int(r["length"]))
        trials = per.setdefault(key, {})
        trials[r["trial"]] = trials.get(r["trial"], r["prefill_s"]) + r["seconds"]
    return {k: statistics.median(v.values()) for k, v in per.items()}


def estimate_lines(
    rows: Sequence[dict], args: Any, others: Sequence[dict], lengths=(1024, 4096)
) -> list[str]:
    """The full run's time (200 trials x tasks x lengths, the two sides concurrent: the slower one per trial).

    A length this run did not reach takes its per-trial time from ``others`` (result.json of other runs,
    e.g. one trial at 4096), scaled task by task: a task not measured there costs its time here times the
    measured tasks' mean ratio between the two lengths, side by side.
    """
    times = trial_seconds(rows)
    for doc in others:
        for k, v in trial_seconds(doc["rows"]).items():
            times.setdefault(k, v)
    base = min(int(r["length"]) for r in rows) if rows else None
    if base is None:
        return []
    sides = ("kvlab", "kvpress") if any(r["side"] == "kvpress" for r in rows) else ("kvlab",)
    lines, total = [], 0.0
    for length in lengths:
        per_task, scaled = [], False
        for task in args.task_list:
            walls = []
            for side in sides:
                t = times.get((side, task, length))
                if t is None:
                    ratios = [
                        times[(side, k[1], length)] / times[(side, k[1], base)]
                        for k in times
                        if k[0] == side and k[2] == length and (side, k[1], base) in times
                    ]
                    if not ratios or (side, task, base) not in times:
                        walls = None
                        break
                    t, scaled = times[(side, task, base)] * sum(ratios) / len(ratios), True
                walls.append(t)
            if walls is None:
                per_task = None
                break
            per_task.append(max(walls))
        if per_task is None:
            lines.append(f"  - {length} tokens: no timing measured (run one trial there with --timing-runs)")
            continue
        sec = 200 * sum(per_task)
        total += sec
        lines.append(
            f"  - {length} tokens: {sec / 3600:.1f} h ({sum(per_task) / len(per_task):.0f} s per trial, mean over tasks"
            + (", scaled from the tasks timed at this length" if scaled else "")
            + ")"
        )
    return [
        f"- estimated full run, 200 trials x {len(args.task_list)} tasks per length on this machine under this run's "
        f"load (median seconds per trial of each side per task from the rows' timers; the two sides overlap, so "
        f"the slower one counts): {total / 3600:.1f} h in all"
        + (
            f" (timings of other runs: {', '.join(str(p) for p in args.timing_runs)})"
            if args.timing_runs
            else ""
        ),
        *lines,
    ]


def _raw_rows_line(folder: Path) -> str:
    where = folder.resolve()
    if where.is_relative_to(ROOT):
        return (
            f"Raw rows: `{where.relative_to(ROOT)}/` (`result.json`, or the archived `kvlab.json.gz` + "
            "`kvpress.jsonl.gz` + `job.json.gz`; job: `job.json` + `trials.jsonl`)."
        )
    return "Raw rows: `result.json` in the run's `--out-dir` (a scratch folder outside the repository)."


def write_report(args, doc: dict, records: Sequence[dict], source: Any, load_before, argv) -> None:
    rows, summary, pool = doc["rows"], doc["summary"], doc["pooled"]
    meta, done = doc["worker_meta"], doc["worker_done"]
    apart = {(t, int(n)) for t, n in doc["calibration"]["apart"]}
    mach = getattr(args, "_machine", None) or machine_facts(args.device)
    hay = getattr(args, "_haystack", None) or haystack_facts(source)
    hay_text = hay["source"] + (
        f" (sha256 {hay['sha256']}…, {hay['chars']:,} characters)" if "sha256" in hay else ""
    )
    kv_rows = [r for r in rows if r["side"] == "kvlab"]
    kp_rows = [r for r in rows if r["side"] == "kvpress"]
    kp_full = [r for r in kp_rows if r["kind"] == "full"]
    checks = [
        r.get("check_max_abs_diff_vs_standalone") for r in kp_rows if "check_max_abs_diff_vs_standalone" in r
    ]
    kp_trials = {(r["task"], r["length"], r["trial"]) for r in kp_rows}
    batched = {(r["task"], r["length"], r["trial"]) for r in kp_rows if r.get("batch_rows", 1) > 1}
    n_trials = len(records)
    kv_s, wall = doc["kvlab_seconds"], doc["wall_seconds"]
    worker_s = done["seconds"] if done else None
    per_trial = max(kv_s, worker_s or 0.0) / max(n_trials, 1)
    # prompt lengths actually reached (context + question ids), per requested length
    reached = {}
    for rec in records:
        reached.setdefault(rec["length"], []).append(len(rec["context"]) + len(rec["question"]))
    cmd = "python3 " + " ".join(
        [
            str(Path(sys.argv[0]).resolve().relative_to(ROOT))
            if argv is None
            else "benchmarks/eval_ruler.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    ).replace(f"{ROOT}/", "")  # paths relative to the repository, never this machine's
    title = (
        f"{model_label(args.model)}, {n_trials} trials ({args.trials} per task x {len(args.task_list)} tasks x "
        f"{len(args.length_list)} lengths), seed {args.seed}; kvlab solid, kvpress dashed"
    )
    figure(pool, args.figure, title)
    pieces_run = getattr(args, "_pieces", None)
    est_lines = []
    if n_trials and done:
        est_lines.append(
            f"- time per trial in this run: kvlab {kv_s / n_trials:.1f} s, kvpress worker {worker_s / n_trials:.1f} s "
            f"(concurrent, on a box other jobs may also have used); wall per trial {per_trial:.1f} s."
        )
    est = estimate_lines(rows, args, [json.loads(Path(p).read_text()) for p in args.timing_runs or []])
    est_lines += est
    md = [
        "# RULER-style eval: kvlab's cache policies"
        + (" (kvlab's side only)" if args.no_kvpress else " side by side with kvpress on identical token ids")
        + (f", {args.trials} trials per task in {len(pieces_run)} pieces" if pieces_run else ""),
        "",
        f"- command: `{cmd}`"
        + (
            f" — the arguments of {len(pieces_run)} pieces (`--first-trial` "
            f"{', '.join(str(p['first_trial']) for p in pieces_run)}, `--trials` "
            f"{', '.join(str(p['trials']) for p in pieces_run)}), each its own process, reported as one run by "
            "`--report-only --merge`"
            + (
                "; the kvpress worker ran on each piece's recorded ids ("
                + (
                    "afterwards: `benchmarks/anchors/run_anchors.py`)"
                    if getattr(args, "_worker_afterwards", True)
                    else "beside it, started by the piece)"
                )
                if done
                else ""
            )
            + "; times below are the pieces' sums"
            if pieces_run
            else ""
        ),
        f"- date: {datetime.datetime.fromtimestamp(doc['started'], datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')} (the run's start); wall time {wall / 60:.1f} min "
        + (
            f"(kvlab only{'' if mach.get('mixed') else f', {args.threads} torch threads'})"
            if args.no_kvpress
            else (
                f"(kvlab's pieces {kv_s / 60:.1f} min in all; the kvpress worker "
                + (
                    "ran afterwards on the pieces' recorded ids"
                    if getattr(args, "_worker_afterwards", True)
                    else "beside each piece, on the ids it recorded"
                )
                + f", {len({(r['task'], r['length'], r['trial']) for r in kp_rows})} trials"
                + (f", {worker_s / 60:.1f} min)" if worker_s else ", stopped part-way)")
                if pieces_run
                else f"(kvlab part {kv_s / 60:.1f} min; kvpress worker "
                f"{worker_s / 60 if worker_s else float('nan'):.1f} min, running concurrently in its own process)"
            )
        ),
        f"- machine: {mach['arch']}, {mach['cpus']} CPU cores shared with other jobs (load average "
        f"{load_before[0]:.2f} at the start), kvlab on {mach['device']}"
        f"{'' if mach.get('mixed') else f', {args.threads} torch thread(s)'}"
        f"{'' if args.no_kvpress else ', the kvpress worker one'}; kvlab torch {mach['torch']}, transformers "
        f"{mach.get('transformers', '?')}; "
        f"kvpress side: {json.dumps(meta['versions']) if meta else '—'}",
        f"- model: {model_label(args.model)}, {args.dtype}, {mach['device']}; haystack: {hay_text}",
        f"- trials: **{args.trials} per task** x tasks {', '.join(args.task_list)} x lengths "
        f"{', '.join(map(str, args.length_list))} = {n_trials} trials (seeds `trial_seed({args.seed}, i)`); prompt "
        "tokens reached (context + question): "
        + "; ".join(f"{k}: {min(v)}–{max(v)}" for k, v in sorted(reached.items())),
        f"- kvlab: `kvlab.eval.run.run_suite` with caches {', '.join(s['spec'] for s in doc['specs'])} "
        "(one prefill per trial, every policy reuses it); KL / top-1 against kvlab's full cache.",
        *calibration_lines(doc["calibration"]),
        *(
            []
            if args.no_kvpress
            else [
                f"- kvpress: presses {', '.join(args.presses.split(','))} at ratios {args.ratios} on the same ids "
                "(context, question, the full cache's answer for teacher forcing: written by this script from the calls "
                "run_suite made), question never compressed (press hooks on the context forward only); one prefill per trial "
                "with every press's own `forward_hook` on its own cache"
                + (
                    f" (checked on the first trial against one standalone `with press(model)` prefill per press: max |ΔK|,|ΔV| "
                    f"= {max(checks):.3g})"
                    if checks
                    else ""
                )
                + (
                    f"; on {len(batched)} of {len(kp_trials)} trials the presses whose caches "
                    "have the same shape (one ratio) decoded as the rows of one batch, the others one press at a time "
                    "(`decode_groups` in `anchor_worker.py`)"
                    if batched
                    else ""
                )
                + "; answers decoded with kvlab's tokenizer and scored with `kvlab.eval.score.score` in kvlab's process; KL "
                "(float64, `token_kl`'s formula) and top-1 computed in the worker against the worker's own full cache on the "
                "same teacher-forced tokens.",
            ]
        ),
    ]
    if kp_full:
        agree = [r["top1_vs_kvlab_full"] for r in kp_full if "top1_vs_kvlab_full" in r]
        kls = [r["kl_kvlab_full_vs_this_full"] for r in kp_full if "kl_kvlab_full_vs_this_full" in r]
        same = sum(
            1
            for r in kp_full
            for k in kv_rows
            if k["kind"] == "full"
            and (k["task"], k["trial"], k["length"]) == (r["task"], r["trial"], r["length"])
            and k["output"] == r["output"]
        )
        md.append(
            f"- both sides' full caches: same decoded answer in {same}/{len(kp_full)} trials; kvpress-side full argmax = "
            f"kvlab full argmax on {100 * sum(agree) / max(len(agree), 1):.2f}% of teacher-forced tokens"
            + (
                f"; KL(kvlab full ‖ kvpress-side full) on the {len(kls)} trials whose logits kvlab saved: at most "
                f"{max(kls):.2g} nats"
                if kls
                else ""
            )
        )
    if doc["failure"]:
        md.append(f"- NOTE: {doc['failure']}")
    if doc["worker_failed_rows"]:
        errs = sorted({f"{w['setup']}: {w['error'][:120]}" for w in doc["worker_failed_rows"]})
        md.append(f"- NOTE: {len(doc['worker_failed_rows'])} kvpress rows failed: " + "; ".join(errs))
    md += [
        *est_lines,
        "",
        f"![accuracy vs ratio]({args.figure.name})",
        "",
        "Accuracy pooled over tasks (the figure's points):",
        "",
        *pooled_lines(pool),
        "",
        "Ranking, paired: each side's caches by pooled accuracy, with the difference to that side's full cache and "
        "to the cache ranked just above, over the trials both ran (Tango's paired score interval, 95%, of the "
        "per-trial differences: not a point when every pair ties; *lower* or *higher* only when the interval "
        "excludes 0):",
        "",
        *ranking_lines(pooled_rows(rows, apart), args.seed),
        "",
        *(
            []
            if args.no_kvpress
            else [
                "Same family, paired on the same trials (kvlab policy vs the kvpress press that implements the same "
                "idea; identical answers and KL mean the same scoring, not always the same slots: kvlab keeps "
                "round(keep × T) slots per head, kvpress int(T × (1 − ratio)), one slot more per head on kvlab's side "
                "where keep × T has a fractional part of .5 or more; the slots themselves are compared in "
                "`benchmarks/results/snapkv_vs_kvpress.md`):",
                "",
                *paired_lines(pooled_rows(rows, apart), args.seed),
                "",
            ]
        ),
        "Per task (accuracy with a Wilson 95% interval over trials; KL in nats per token over question + answer "
        "and top-1 with bootstrap intervals):",
        "",
        *table_lines(summary),
        "",
        _raw_rows_line(getattr(args, "raw", None) or args.out_dir),
    ]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    old = args.results.read_text() if args.results.exists() else ""
    block = re.search(r"<!-- summary -->\n.*?\n<!-- /summary -->\n", old, re.S)
    if block:  # carried over for its rows to be updated: assemble.py refuses figures the new body lacks
        md[1:1] = ["", block.group(0).rstrip("\n")]
    args.results.write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    run_main(main)
