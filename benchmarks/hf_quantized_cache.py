"""Benchmark: kvlab's codecs beside transformers' own ``QuantizedCache`` on the RULER-style trials (issue 31).

transformers quantizes a cache with ``QuantizedCache(backend="quanto", nbits=2|4)`` (optimum-quanto, its
defaults: ``axis_key=axis_value=0``, ``q_group_size=64``, ``residual_length=128``). On its first update (the
prefill) each layer quantizes the whole context; later tokens sit in a full-precision residual until 128 of
them have come. A RULER question and answer stay under 128 tokens, so what that cache attends over while it
answers is the dequantized context plus the question and answer in full precision: here each layer's
context K/V goes through transformers' own ``QuantoQuantizedLayer`` (the class ``QuantizedCache`` builds),
and the dequantized result is a snapshot that :func:`kvlab.eval.run.run_trial` runs beside kvlab's codecs
(``external=``), in the same batch, on the same teacher-forced tokens. The first trial checks it: the
question's logits from a live ``QuantizedCache`` equal the snapshot's to float32 rounding.

Bytes held are what each stores for the context: quanto's packed codes plus its fp32 scale and shift per
group of 64; kvlab's :attr:`~kvlab.policy.quant.snapshot.QuantizedSnapshot.nbytes`.

    pip install -e ".[quanto]"; python3 benchmarks/hf_quantized_cache.py --trials 10
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from _common import write_page

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "hf_quantized_cache.md"
OUT = HERE / "out" / "hf_quantized_cache"
KVLAB_CODECS = ("int4", "kivi:int4", "int2", "kivi:int2")
HF_BITS = (4, 2)


def quanto_bytes(q) -> int:
    """K or V bytes of one quanto-quantized tensor: the packed codes, the scales and the shifts."""
    return sum(int(t.untyped_storage().nbytes()) for t in (q._data._data, q._scale, q._shift))


def hf_quantized(snapshot, bits: int):
    """What ``QuantizedCache(backend="quanto", nbits=bits)`` attends over after the prefill: each layer's
    context K/V through transformers' ``QuantoQuantizedLayer`` (its defaults), dequantized; and its bytes."""
    from transformers.cache_utils import QuantoQuantizedLayer

    keys, values, nbytes = [], [], 0
    for k, v in zip(snapshot.keys, snapshot.values, strict=True):
        layer = QuantoQuantizedLayer(nbits=bits)
        layer.update(k, v)
        keys.append(layer._dequantize(layer._quantized_keys).to(k.dtype))
        values.append(layer._dequantize(layer._quantized_values).to(v.dtype))
        nbytes += quanto_bytes(layer._quantized_keys) + quanto_bytes(layer._quantized_values)
    return snapshot.replace(keys=tuple(keys), values=tuple(values), provenance="quantized"), nbytes


def external(snapshot) -> dict:
    return {f"hf-quanto{b}": hf_quantized(snapshot, b) for b in HF_BITS}


@torch.no_grad()
def live_check(handle, trial) -> float:
    """max |logit difference| between a live ``QuantizedCache`` and its snapshot, on one question."""
    from transformers import QuantizedCache

    from kvlab.eval.tasks import encoder

    encode = encoder(handle)
    ctx, question = encode(trial.context), encode(trial.question)
    worst = 0.0
    for bits in HF_BITS:
        cache = QuantizedCache(backend="quanto", config=handle.config, nbits=bits)
        handle.run(torch.tensor([ctx]), cache)
        live = handle.run(torch.tensor([question]), cache).logits[0].float()
        snap, _ = hf_quantized(handle.prefill(ctx, all_logits=False).snapshot, bits)
        offline = handle.forward(question, past=snap).logits
        worst = max(worst, float((live - offline).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--tasks", default="", help="comma-separated (default: every task)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvlab import load_model
    from kvlab.data import default_long_text
    from kvlab.eval.run import run_suite, summarize
    from kvlab.eval.specs import parse_cache_specs
    from kvlab.eval.tasks import TASKS, make_trial, trial_seed
    from kvlab.metrics.stats import bootstrap_ci

    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        print("this benchmark needs optimum-quanto: pip install -e '.[quanto]'", file=sys.stderr)
        sys.exit(2)
    started, load = time.time(), os.getloadavg()[0]
    handle = load_model("smollm2-135m", device="cpu", dtype="float32")
    source = default_long_text()
    tasks = [t for t in args.tasks.split(",") if t] or list(TASKS)
    check = live_check(
        handle, make_trial(tasks[0], handle, args.length, trial_seed(args.seed, 0), source.text)
    )
    specs = parse_cache_specs(["full", *KVLAB_CODECS])
    rows = run_suite(
        handle,
        specs,
        tasks=tasks,
        lengths=[args.length],
        trials=args.trials,
        seed=args.seed,
        haystack_text=source.text,
        external=external,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rows.json").write_text(json.dumps(rows))
    wall = time.time() - started
    names = ["full", *KVLAB_CODECS, *(f"hf-quanto{b}" for b in HF_BITS)]
    md = [
        "## kvlab's codecs beside transformers' QuantizedCache (RULER-style trials)",
        "",
        f"- command: `python3 benchmarks/hf_quantized_cache.py {' '.join(sys.argv[1:])}`",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; wall {wall / 60:.1f} min; "
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores (load average {load:.2f} at the start), no GPU, "
        f"{args.threads} torch threads; torch {torch.__version__}",
        f"- model: SmolLM2-135M-Instruct (bundled), float32; haystack: {source.source}; tasks {', '.join(tasks)} at "
        f"{args.length} tokens, {args.trials} trials each (seeds `trial_seed({args.seed}, i)`)",
        '- transformers: `QuantizedCache(backend="quanto", nbits=4|2)` with its defaults (axis 0, groups of 64, '
        "residual 128): each layer's context through `QuantoQuantizedLayer`, dequantized; checked on the first "
        f"trial against a live `QuantizedCache`: max |Δ logit| = {check:.2g}",
        "- kvlab: `int<b>` (per-token groups) and `kivi:int<b>` (KIVI: keys per channel, values per token), "
        "`kvlab.policy.quant`; every cache in one batch per trial, KL / top-1 on the same teacher-forced tokens",
        "",
        "| cache | trials | accuracy [95% CI] | KL nats [95% CI] | top-1 [95% CI] | context K/V bytes per token |",
        "|---|---:|---|---|---|---:|",
    ]
    for name in names:
        rs = [r for r in rows if r["spec"] == name]
        acc = bootstrap_ci([r["score"] for r in rs], seed=args.seed)
        kl = bootstrap_ci([r["kld"] for r in rs], seed=args.seed)
        top = bootstrap_ci([r["top1"] for r in rs], seed=args.seed)
        bpt = sum(r["kv_bytes"] for r in rs) / sum(r["context_tokens"] for r in rs)
        md.append(
            f"| {name} | {len(rs)} | {acc.value:.2f} [{acc.low:.2f}, {acc.high:.2f}] | {kl.value:.3g} "
            f"[{kl.low:.3g}, {kl.high:.3g}] | {top.value:.3f} [{top.low:.3f}, {top.high:.3f}] | {bpt:,.0f} |"
        )
    md += [
        "",
        "Per task (accuracy):",
        "",
        "| task | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    summary = {(s["task"], s["cache"]): s for s in summarize(rows, seed=args.seed)}
    for task in tasks:
        md.append(
            f"| {task} | "
            + " | ".join(
                f"{summary[(task, n)]['accuracy']['value']:.2f}" for n in names if (task, n) in summary
            )
            + " |"
        )
    md += ["", "Raw rows: `benchmarks/out/hf_quantized_cache/rows.json`."]
    write_page(args.results, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
