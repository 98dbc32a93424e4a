"""Does the small-batch ``F.linear`` rewrite (``(W @ x.T).T`` for 2-8 rows) pay in batched rolling decode?

Issue 28, item 6: the rewrite stays only if a whole decode shows it pays on this machine. Two modes:

* ``--rewrite on|off``: one whole command (load SmolLM2-135M, prefill ``--rows`` rolling caches, run
  ``--steps`` batched decode steps through :func:`kvlab.hf.batch.step_rolling_rows`) with the rewrite
  forced on or off. Time two such commands side by side, alternating, from outside
  (e.g. ``/usr/bin/time -v``), under ``OMP_NUM_THREADS=1`` and ``=2``.
* ``--compare``: in one process, the decode loop with the rewrite on and off in alternating
  rounds, paired ratio per round, and each linear shape of the model timed both ways; writes
  ``benchmarks/results/archive/small_batch_linear.md`` (the rewrite it measured was removed).

The rewrite measured is the one kvlab's batched step applied until issue 28 (a ``TorchFunctionMode``
routing ``F.linear`` on 2-8 rows through ``(W @ x.T).T``); it lives here now, since it did not pay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402
from kvlab import load_model  # noqa: E402
from kvlab.hf.batch import step_rolling_rows  # noqa: E402
from kvlab.hf.rolling_cache import rolling_cache_for  # noqa: E402
from kvlab.streaming.generate import feed  # noqa: E402

MODEL = "smollm2-135m"


class SmallBatchLinear(TorchFunctionMode):
    """``F.linear`` on 2-8 rows as ``(W @ x.T).T`` (the rewrite removed from ``kvlab.hf.batch``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1]
            if 2 <= rows <= 8 and w.dim() == 2:
                y = (w @ x.reshape(rows, -1).T).T.reshape(*x.shape[:-1], w.shape[0])
                return y if bias is None else y + bias
        return func(*args, **kwargs)


def prepare(handle, rows: int, prompt: int):
    g = torch.Generator().manual_seed(0)
    caches = [rolling_cache_for(handle, window=256, sinks=4, evict_chunk=32) for _ in range(rows)]
    firsts = []
    for r, cache in enumerate(caches):  # different lengths, as in the server
        n = prompt + 17 * r
        firsts.append(feed(handle, cache, torch.randint(5, 20000, (n,), generator=g).tolist()))
    return caches, [int(f.argmax()) for f in firsts]


def decode(handle, caches, tokens, steps: int, rewrite: bool) -> tuple[float, torch.Tensor]:
    """Seconds for ``steps`` greedy batched steps; returns them and the last step's logits."""
    logits = torch.empty(0)
    t0 = time.perf_counter()
    for _ in range(steps):
        if rewrite:
            with SmallBatchLinear():
                logits = step_rolling_rows(handle, caches, tokens)
        else:
            logits = step_rolling_rows(handle, caches, tokens)
        tokens = [int(t) for t in logits.argmax(-1)]
    return time.perf_counter() - t0, logits


def whole(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    handle = load_model(MODEL)
    caches, tokens = prepare(handle, args.rows, args.prompt)
    seconds, _ = decode(handle, caches, tokens, args.steps, args.rewrite == "on")
    print(
        f"rewrite {args.rewrite}: {args.steps} steps x {args.rows} rows, {seconds / args.steps * 1e3:.1f} ms/step"
    )


def linear_shapes(handle) -> list[tuple[str, torch.Tensor]]:
    seen: dict[tuple[int, int], tuple[list[str], torch.Tensor]] = {}
    for name, mod in handle.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            names, _ = seen.setdefault(tuple(mod.weight.shape), ([], mod.weight))
            if name.split(".")[-1] not in names:
                names.append(name.split(".")[-1])
    return [("/".join(names), w) for names, w in seen.values()]


def per_linear(handle, rows: int, repeats: int = 30) -> list[str]:
    counts: dict[tuple[int, int], int] = {}
    for mod in handle.model.modules():
        if isinstance(mod, torch.nn.Linear):
            counts[tuple(mod.weight.shape)] = counts.get(tuple(mod.weight.shape), 0) + 1
    out = []
    with torch.no_grad():
        for name, w in linear_shapes(handle):
            x = torch.randn(rows, 1, w.shape[1], dtype=w.dtype)
            plain, swapped = [], []
            for _ in range(repeats):  # alternating, paired
                t = time.perf_counter()
                F.linear(x, w)
                plain.append(time.perf_counter() - t)
                with SmallBatchLinear():
                    t = time.perf_counter()
                    F.linear(x, w)
                    swapped.append(time.perf_counter() - t)
            ratio = statistics.median(p / s for p, s in zip(plain, swapped, strict=True))
            n = counts[tuple(w.shape)]
            out.append(
                f"| {name} {w.shape[0]}x{w.shape[1]} | {n} | {statistics.median(plain) * 1e3:.3f} | "
                f"{statistics.median(swapped) * 1e3:.3f} | {ratio:.2f} |"
            )
    return out


def interval(ratios: list[float]) -> tuple[float, float]:
    """Bootstrap 95% interval of the median ratio."""
    g = torch.Generator().manual_seed(0)
    r = torch.tensor(ratios)
    idx = torch.randint(0, len(ratios), (2000, len(ratios)), generator=g)
    meds = r[idx].median(dim=1).values.sort().values
    return float(meds[50]), float(meds[1949])


def compare(args) -> None:
    handle = load_model(MODEL)
    lines = [
        f"SmolLM2-135M, {args.rows} rolling caches (prompts of {args.prompt}-{args.prompt + 17 * (args.rows - 1)} "
        f"tokens, sinks 4 + window 256), {args.steps} greedy steps of `step_rolling_rows` per round; "
        f"{args.rounds} rounds alternating rewrite off / on (order swapped every round). Ratio = off / on "
        "per round (> 1: the rewrite pays), median with a bootstrap 95% interval.",
        "",
        "| threads | off ms/step | on ms/step | off / on | 95% interval | max abs logit diff |",
        "|---|---|---|---|---|---|",
    ]
    for threads in args.threads:
        torch.set_num_threads(threads)
        off_t, on_t, ratios, diff = [], [], [], 0.0
        for rnd in range(args.rounds + 1):
            got = {}
            for rewrite in (False, True) if rnd % 2 else (True, False):
                caches, tokens = prepare(handle, args.rows, args.prompt)
                got[rewrite] = decode(handle, caches, tokens, args.steps, rewrite)
            if rnd == 0:
                continue  # warm-up
            off_t.append(got[False][0] / args.steps * 1e3)
            on_t.append(got[True][0] / args.steps * 1e3)
            ratios.append(got[False][0] / got[True][0])
            diff = max(diff, float((got[False][1] - got[True][1]).abs().max()))
        lo, hi = interval(ratios)
        lines.append(
            f"| {threads} | {statistics.median(off_t):.1f} | {statistics.median(on_t):.1f} | "
            f"{statistics.median(ratios):.2f} | {lo:.2f}-{hi:.2f} | {diff:.1e} |"
        )
        print(lines[-1], flush=True)
    torch.set_num_threads(1)
    lines += [
        "",
        f"Each linear shape of the model alone, {args.rows} rows, 1 thread (median of 30 alternating calls; "
        "ratio > 1: the transposed product is faster):",
        "",
        "| linear | layers | F.linear ms | (W @ x.T).T ms | ratio |",
        "|---|---|---|---|---|",
        *per_linear(handle, args.rows),
    ]
    write_results(
        "small_batch_linear", "Small-batch F.linear rewrite in batched rolling decode", "\n".join(lines)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rewrite", choices=("on", "off"), help="one whole decode with the rewrite forced on or off"
    )
    ap.add_argument("--compare", action="store_true", help="both, in one process; writes the results")
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=200, help="first row's prompt length")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=8, help="--compare: paired rounds per thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="--compare: thread counts")
    args = ap.parse_args()
    if args.rewrite and not args.compare:
        whole(args)
    elif args.compare:
        compare(args)
    else:
        ap.error("give --rewrite on|off or --compare")


if __name__ == "__main__":
    main()
