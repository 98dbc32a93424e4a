"""Rolling cache benchmark: roll cost, re-base cost, streaming throughput, memory, streaming perplexity.

Run: ``python3 benchmarks/rolling.py`` (add ``--gen-tokens 20000`` for the long memory run,
``--quick`` for a smoke run). Every timing is a ratio of two things measured side by side in this
run (interleaved, median of repeats), because absolute times on a shared machine are noise.
Writes ``benchmarks/results/rolling.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from kvlab import load_model
from kvlab.data import shared_book
from kvlab.hf import new_hf_cache
from kvlab.hf.rolling_cache import rolling_cache_for, rotate_by
from kvlab.streaming import stream_generate, streaming_perplexity
from kvlab.streaming.generate import feed

RESULTS = Path(__file__).resolve().parent / "results" / "rolling.md"


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_roll(h, window: int, chunk: int, sinks: int, repeats: int) -> list[list]:
    """A roll's extra work (sink re-rotation + slicing, folded into the step's concatenation) vs a full prefill."""
    ids = torch.randint(100, 20000, (1, window + sinks), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with torch.no_grad():
        h.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    cache = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk)
    with torch.no_grad():
        h.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    layers = [(lay.keys.clone(), lay.values.clone(), lay.sink_keys.clone()) for lay in cache.layers]
    kv, hd = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    new_k = torch.randn(1, kv, 1, hd)

    def step(drop: int, rebase: int = 0):
        # Reset to the full state, then one cache-level update of every layer (no model compute).
        for lay, (k, v, s) in zip(cache.layers, layers, strict=True):
            lay.keys, lay.values, lay.sink_keys = k, v, s
        cache.slots, cache.base = window + sinks, 0
        cache.plan.drop, cache.plan.rebase = drop, rebase
        cache._sinks_rotated = None  # no reuse across repeats: every roll re-rotates the sinks
        for i in range(len(cache.layers)):
            cache.update(new_k, new_k, i)

    roll_ms, plain_ms, rebase_ms, clone_ms = [], [], [], []
    for _ in range(repeats):  # interleaved
        roll_ms.append(median_ms(lambda: step(chunk), 3))
        plain_ms.append(median_ms(lambda: step(0), 3))
        rebase_ms.append(median_ms(lambda: step(chunk, chunk + 4096), 3))
        clone_ms.append(median_ms(lambda: [k.clone() for k, _, _ in layers], 3))
    roll, plain = statistics.median(roll_ms), statistics.median(plain_ms)
    rebase, clone = statistics.median(rebase_ms), statistics.median(clone_ms)
    extra = max(roll - plain, 1e-6)
    rows = [
        ["full prefill of W tokens", f"{prefill_ms:,.1f} ms", ""],
        [
            f"cache update, step with a roll of {chunk} (all layers)",
            f"{roll:.3f} ms",
            f"{prefill_ms / roll:,.0f}x below prefill",
        ],
        ["cache update, plain step (same concatenation, DynamicCache-like)", f"{plain:.3f} ms", ""],
        ["extra work of a roll (difference)", f"{extra:.3f} ms", f"{prefill_ms / extra:,.0f}x below prefill"],
        [f"amortized per token (roll every {chunk})", f"{extra / chunk * 1e3:.2f} us", ""],
        ["plain clone of the key cache", f"{clone:.3f} ms", "1.00x"],
        [
            "cache update, step with a roll + full re-base (rotation written into the step's output)",
            f"{rebase:.3f} ms",
            f"{rebase / clone:.2f}x a clone; {rebase / plain:.2f}x a plain step",
        ],
    ]
    return rows


def bench_rebase(h, window: int, repeats: int) -> list[list]:
    keys = [torch.randn(1, h.facts.num_kv_heads, window, h.facts.head_dim) for _ in range(h.facts.num_layers)]
    clone, rebase = [], []
    for _ in range(repeats):
        clone.append(median_ms(lambda: [k.clone() for k in keys], 3))
        rebase.append(median_ms(lambda: [rotate_by(k, -4096, h.rope) for k in keys], 3))
    c, r = statistics.median(clone), statistics.median(rebase)
    return [
        ["plain clone of the key cache", f"{c:.2f} ms", ""],
        [
            "standalone re-base pass (rotate every key by -4096, new tensors)",
            f"{r:.2f} ms",
            f"{r / c:.2f}x a clone",
        ],
    ]


def bench_throughput(h, window: int, sinks: int, chunk: int, blocks: int, steps: int) -> list[list]:
    """Decode tokens/s: RollingCache (rolling every ``chunk`` tokens) vs DynamicCache at the same length."""
    ids = torch.randint(100, 20000, (1, window + sinks), generator=torch.Generator().manual_seed(1))
    roll = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk)
    dyn = new_hf_cache(h.config)
    with torch.no_grad():
        h.model(input_ids=ids, past_key_values=roll, use_cache=True, logits_to_keep=1)
        h.model(
            input_ids=ids[:, : window + sinks - chunk], past_key_values=dyn, use_cache=True, logits_to_keep=1
        )
    tok = torch.tensor([[1234]])
    r_times, d_times = [], []
    with torch.no_grad():
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(steps):
                h.model(input_ids=tok, past_key_values=roll, use_cache=True)
            r_times.append(steps / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(steps):
                h.model(input_ids=tok, past_key_values=dyn, use_cache=True)
            d_times.append(steps / (time.perf_counter() - t0))
            dyn.crop(-steps)  # keep the DynamicCache at the same length band
    r, d = statistics.median(r_times), statistics.median(d_times)
    return [
        [
            f"RollingCache decode ({sinks} sinks + {window}, rolls every {chunk})",
            f"{r:.2f} tokens/s",
            f"{r / d:.3f}x",
        ],
        [
            f"DynamicCache decode at {window + sinks - chunk}..{window + sinks - chunk + steps} tokens",
            f"{d:.2f} tokens/s",
            "1.000x",
        ],
        ["rolls during the measurement", str(roll.rolls), ""],
    ]


def bench_memory(h, window: int, sinks: int, chunk: int, tokens: int, max_position: int | None) -> list[list]:
    cache = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk, max_position=max_position)
    first = feed(h, cache, h.encode("It was a dark and stormy night; the rain fell in torrents, except at"))
    samples, max_pos, rebases = [], 0, 0
    t0 = time.perf_counter()
    for ev in stream_generate(h, cache, first, tokens, temperature=0.8, seed=0):
        max_pos = max(max_pos, ev.position)
        rebases += ev.rebased
        if ev.step % 250 == 0:
            samples.append((ev.step, rss_mib()))
    elapsed = time.perf_counter() - t0
    base = [r for s, r in samples if s >= min(tokens // 5, 1000)] or [samples[-1][1]]
    growth = (samples[-1][1] - base[0]) / base[0] * 100
    limit = max_position or h.max_positions
    return [
        ["tokens generated", f"{tokens:,}", f"{tokens / elapsed:.1f} tokens/s"],
        ["RSS after warm-up / at the end", f"{base[0]:,.0f} / {samples[-1][1]:,.0f} MiB", f"{growth:+.2f}%"],
        ["peak RSS (ru_maxrss)", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB", ""],
        ["largest RoPE position fed", f"{max_pos:,}", f"limit {limit:,}"],
        ["re-bases / rolls", f"{rebases} / {cache.rolls}", ""],
        ["cache bytes at the end", f"{cache.nbytes() / 2**20:.1f} MiB", ""],
    ]


def bench_ppl(
    h, books: list[str], windows: list[int], tokens: int, samples: int
) -> tuple[list[list], list[str]]:
    rows, sources = [], []
    for name in books:
        book = shared_book(name)
        if book is None:
            print(f"  (skipping {name}: ../shared/data is absent)", file=sys.stderr)
            continue
        ids = h.encode(book.text[: tokens * 8])[:tokens]
        sources.append(f"{name} ({len(ids)} tokens)")
        for w in windows:
            res = streaming_perplexity(h, ids, window=w, feed=16, recompute_samples=samples)
            sub = res["recompute"].targets
            rec = res["recompute"].ppl
            for m, r in res.items():
                ratio = r.ppl_on(sub) / rec
                rows.append(
                    [name, w, m, f"{r.ppl:.2f}", f"{r.ppl_on(sub):.2f}", f"{ratio:.3f}", f"{r.seconds:.1f}"]
                )
    return rows, sources


def table(title: str, cols: list[str], rows: list[list]) -> str:
    out = [f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--gen-tokens", type=int, default=3000, help="tokens for the memory run (issue: 20000)")
    ap.add_argument(
        "--max-position", type=int, default=None, help="override the position limit (forces re-bases)"
    )
    ap.add_argument("--ppl-tokens", type=int, default=3000)
    ap.add_argument("--samples", type=int, default=100, help="targets re-computed exactly per window")
    ap.add_argument("--books", default="frankenstein", help="comma-separated shared books")
    ap.add_argument("--skip-ppl", action="store_true")
    args = ap.parse_args()
    h = load_model("smollm2-135m")
    q = args.quick
    parts = []
    t_start = time.perf_counter()
    w_roll = 256 if q else 2048
    print("roll cost ...", file=sys.stderr)
    parts.append(
        table(
            f"Roll cost at W = {w_roll}, 4 sinks, evicting 64 at a time",
            ["what", "time", "ratio"],
            bench_roll(h, w_roll, 64, 4, 5 if q else 15),
        )
    )
    write(parts, t_start)
    print("re-base cost ...", file=sys.stderr)
    parts.append(
        table(
            f"Re-base pass vs clone, {h.facts.num_layers} layers x W = {w_roll}",
            ["what", "time", "ratio"],
            bench_rebase(h, w_roll, 5 if q else 15),
        )
    )
    print("throughput ...", file=sys.stderr)
    w_tp = 256 if q else 1024
    parts.append(
        table(
            f"Streaming decode throughput at W = {w_tp} (interleaved blocks)",
            ["cache", "throughput", "ratio"],
            bench_throughput(h, w_tp, 4, 64, 3 if q else 8, 16 if q else 32),
        )
    )
    write(parts, t_start)
    print("memory ...", file=sys.stderr)
    n_gen = 300 if q else args.gen_tokens
    parts.append(
        table(
            f"Memory over {n_gen:,} generated tokens (4 sinks + 256, sampled at T=0.8)",
            ["what", "value", ""],
            bench_memory(h, 256, 4, 64, n_gen, args.max_position),
        )
    )
    write(parts, t_start)
    if not args.skip_ppl:
        print("streaming perplexity ...", file=sys.stderr)
        rows, sources = bench_ppl(
            h,
            args.books.split(","),
            [128] if q else [256, 512],
            400 if q else args.ppl_tokens,
            16 if q else args.samples,
        )
        if rows:
            parts.append(
                table(
                    "Streaming perplexity (feed 16, evict 16)",
                    [
                        "book",
                        "window",
                        "method",
                        "ppl (all)",
                        "ppl (subsample)",
                        "x recompute (subsample)",
                        "seconds",
                    ],
                    rows,
                )
                + f"\nSources: {', '.join(sources)}. 'recompute' = sliding window with re-computation on "
                f"{16 if q else args.samples} random targets; every method is also scored on those targets.\n"
            )
    write(parts, t_start)


def write(parts: list[str], t_start: float) -> None:
    cmd = "python3 " + " ".join([sys.argv[0].split("/work/main/")[-1], *sys.argv[1:]])
    header = (
        f"# Rolling cache benchmark\n\n`{cmd}` — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"{platform.machine()}, SmolLM2-135M fp32, total {time.perf_counter() - t_start:.0f} s. "
        "Shared machine: ratios are measured side by side in this run; absolute times are indicative only.\n"
    )
    text = header + "\n" + "\n".join(parts)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
