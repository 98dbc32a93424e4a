"""Sinks + a rolling window over a quantized history, on the bundled model: long generation with bounded
memory, and the perplexity cost against the same window in full precision, with an interval.

``python benchmarks/coded_window.py --tokens 20000 --window 1024 --codec kivi4``:

1. **Generation**: ``model.generate`` with ``cache_for("sinks=4,window=W,codec=C", model)`` (bound: the
   decode steps read the packed codes) for ``--tokens`` new tokens after a short prompt; the K/V bytes
   the cache holds are read at every step (a logits processor), so the maximum is the true peak;
   the same for the full-precision window (``sinks=4,window=W``).
2. **Perplexity**: ``--ppl-tokens`` tokens of Frankenstein fed one at a time through each cache (prompt
   of ``W`` tokens in one forward first), the NLL of every next token kept; the ratio of the coded
   window's perplexity to the full-precision window's is a paired bootstrap over tokens
   (:func:`kvlab.metrics.bootstrap_ci` on the per-token NLL difference, exponentiated).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402


def _generate(handle, spec: str, prompt: torch.Tensor, n: int) -> dict:
    from kvlab.hf.policy_cache import held_bytes
    from kvlab.policy.spec import cache_for

    cache = cache_for(spec, handle)
    seen: list[int] = []

    def watch(_ids, scores):
        seen.append(held_bytes(cache))
        return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        out = handle.model.generate(
            prompt, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, logits_processor=[watch]
        )
    wall = time.perf_counter() - t0
    return {
        "spec": spec,
        "new_tokens": int(out.shape[-1] - prompt.shape[-1]),
        "seconds": wall,
        "ms_per_token": 1000 * wall / n,
        "max_bytes": max(seen),
        "bytes_at": {str(i): seen[i] for i in (0, n // 10, n // 2, n - 1) if i < len(seen)},
        "rolls": cache.rolls,
        "rebases": cache.rebases,
        "packed_steps": getattr(cache, "packed_steps", 0),
        "final_position": cache.next_position,
    }


@torch.no_grad()
def _nll(handle, spec: str, ids: torch.Tensor, prompt: int) -> np.ndarray:
    """Per-token NLL of ``ids[prompt+1:]`` fed one at a time after a ``prompt``-token forward."""
    from kvlab.policy.spec import cache_for

    cache = cache_for(spec, handle)
    logits = handle.run(ids[:, :prompt], cache).logits[0, -1].float()
    out = []
    for i in range(prompt, ids.shape[-1]):
        out.append(float(torch.log_softmax(logits, -1)[ids[0, i]]))
        logits = handle.run(ids[:, i : i + 1], cache).logits[0, -1].float()
    return -np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--ppl-tokens", type=int, default=3000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--codec", default="kivi4")
    ap.add_argument("--skip-fp-generate", action="store_true")
    ap.add_argument(
        "--results-name", default="coded_window", help="results file (benchmarks/results/NAME.md)"
    )
    args = ap.parse_args()

    from kvlab.data import default_long_text
    from kvlab.metrics import bootstrap_ci
    from kvlab.model import load_model

    handle = load_model("smollm2-135m")
    coded, fp = f"sinks=4,window={args.window},codec={args.codec}", f"sinks=4,window={args.window}"
    prompt = torch.tensor([handle.tokenizer.encode("Once upon a time, in a quiet town by the sea,")])
    runs = [_generate(handle, coded, prompt, args.tokens)]
    if not args.skip_fp_generate:
        runs.append(_generate(handle, fp, prompt, args.tokens))
    print(json.dumps({"runs": runs}), flush=True)  # kept even if the perplexity part fails
    rows = "\n".join(
        f"| `{r['spec']}` | {r['new_tokens']:,} | {r['ms_per_token']:.1f} | {r['max_bytes'] / 2**20:.2f} MiB | "
        f"{r['bytes_at'].get(str(args.tokens // 10), 0) / 2**20:.2f} → {r['bytes_at'].get(str(args.tokens - 1), 0) / 2**20:.2f} MiB | "
        f"{r['rolls']} / {r['rebases']} | {r['packed_steps']:,} |"
        for r in runs
    )
    generation = f"""Generation through `model.generate` with the cache `kvlab.policy.cache_for(spec)` builds
(greedy, prompt "Once upon a time, ..."); bytes = K/V the cache holds, read at every step.

| spec | new tokens | ms / token | peak bytes | bytes at 10% → end | rolls / re-bases | packed-code steps |
|---|---|---|---|---|---|---|
{rows}
"""
    if args.ppl_tokens <= 0:  # generation only
        write_results(
            args.results_name, "A rolling window over a quantized history: long generation", generation
        )
        return
    text = default_long_text()
    ids = torch.tensor([handle.tokenizer.encode(text.text)[: args.window + args.ppl_tokens + 1]])
    t0 = time.perf_counter()
    nll_c, nll_f = _nll(handle, coded, ids, args.window), _nll(handle, fp, ids, args.window)
    ppl_s = time.perf_counter() - t0
    diff = bootstrap_ci(list(nll_c - nll_f), seed=0)
    ratio = {k: math.exp(v) for k, v in (("mean", diff.value), ("low", diff.low), ("high", diff.high))}
    body = f"""{generation}
Perplexity on {text.source}: {args.ppl_tokens:,} tokens fed one at a time after a {args.window}-token prompt,
through each cache ({ppl_s:.0f} s for both): perplexity {math.exp(nll_c.mean()):.3f} (`{coded}`) vs
{math.exp(nll_f.mean()):.3f} (`{fp}`); **ratio {ratio["mean"]:.4f} [{ratio["low"]:.4f}, {ratio["high"]:.4f}]**
(95% paired bootstrap over tokens).
"""
    write_results(args.results_name, "A rolling window over a quantized history (bundled model)", body)
    raw = {
        "runs": runs,
        "ppl": {"coded": float(math.exp(nll_c.mean())), "fp": float(math.exp(nll_f.mean())), "ratio": ratio},
    }
    print(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
