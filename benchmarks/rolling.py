"""Rolling cache benchmark: roll cost, re-base cost, streaming throughput, memory, streaming perplexity.

Run: ``OMP_NUM_THREADS=1 python3 benchmarks/rolling.py`` (add ``--gen-tokens 20000`` for the long
memory run, ``--sections memory`` to run one section, ``--quick`` for a smoke run). Every timing is a ratio of two things measured side by side in this
run (interleaved, median of repeats), because absolute times on a shared machine are noise.
Writes ``benchmarks/results/rolling.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _common import write_page
from kvlab import load_model
from kvlab.data import default_long_text, shared_book
from kvlab.hf import new_hf_cache
from kvlab.hf.rolling_cache import RollPlan, rolling_cache_for, rotate_by, rotate_by_
from kvlab.rope.ops import shift_keys
from kvlab.streaming import (
    TABLE_COLUMNS,
    stream_generate,
    stream_nll,
    streaming_perplexity,
    summarize,
    table_row,
)
from kvlab.streaming.generate import feed
from kvlab.streaming.perplexity import METHODS

RESULTS = Path(__file__).resolve().parent / "results" / "rolling.md"


def cpu_ms(fn, repeats: int = 3) -> float:
    """Median CPU time (this process, user + system) of ``repeats`` calls, in ms.

    On a shared, oversubscribed machine wall time mostly measures the scheduler: a 3 ms clone fits in
    one time slice while a 30 ms pass waits several times. CPU time counts only the work done.
    """
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1e3)
    return statistics.median(times)


def paired(times: dict[str, list[float]], base: str) -> dict[str, float]:
    """Median over rounds of ``times[k][i] / times[base][i]`` (each round measured side by side)."""
    return {
        k: statistics.median(a / b for a, b in zip(v, times[base], strict=True)) for k, v in times.items()
    }


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_roll(h, window: int, chunk: int, sinks: int, repeats: int) -> list[list]:
    """Cache updates in place: a plain step, a roll (window moved down once per chunk, sinks re-rotated)
    and a re-base, against a DynamicCache-style concatenation and a full prefill."""
    ids = torch.randint(100, 20000, (1, window + sinks), generator=torch.Generator().manual_seed(0))
    t0 = time.process_time()  # CPU time, like the cache updates below
    with torch.no_grad():
        h.run(ids, logits_to_keep=1)
    prefill_ms = (time.process_time() - t0) * 1e3
    cache = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk)
    with torch.no_grad():
        h.run(ids, cache, logits_to_keep=1)
    saved = [(lay._buf_k.clone(), lay._buf_v.clone(), lay.sink_keys.clone()) for lay in cache.layers]
    full = [(lay.keys.clone(), lay.values.clone()) for lay in cache.layers]  # what a DynamicCache holds
    kv, hd = cache.layers[0].keys.shape[1], cache.layers[0].keys.shape[3]
    new_k = torch.randn(1, kv, 1, hd)
    held = window + sinks

    def reset(drop: int, rebase: int) -> None:
        """Back to the full state with a pending plan (untimed: a copy of the buffers)."""
        for lay, (bk, bv, sk) in zip(cache.layers, saved, strict=True):
            lay._buf_k.copy_(bk)
            lay._buf_v.copy_(bv)
            lay.sink_keys = sk
            lay.keys, lay.values = lay._buf_k[:, :, :held], lay._buf_v[:, :, :held]
            lay.slots, lay.base, lay.plan = held, 0, RollPlan(drop=drop, rebase=rebase)

    def step_ms(drop: int, rebase: int = 0, repeats: int = 3) -> float:
        """Median CPU time of one cache-level update of every layer (no model compute), state reset between."""
        times = []
        for _ in range(repeats):
            reset(drop, rebase)
            t0 = time.process_time()
            for i in range(len(cache.layers)):
                cache.update(new_k, new_k, i)
            times.append((time.process_time() - t0) * 1e3)
        return statistics.median(times)

    def dynamic_step() -> None:  # what DynamicCache's update does: concatenate K and V of every layer
        for k, v in full:
            torch.cat([k, new_k], dim=-2), torch.cat([v, new_k], dim=-2)

    fns = {
        "roll": lambda: step_ms(chunk),
        "plain": lambda: step_ms(0),
        "rebase": lambda: step_ms(chunk, chunk + 4096),
        "dynamic": lambda: cpu_ms(dynamic_step),
        "clone": lambda: cpu_ms(lambda: [k.clone() for k, _ in full]),
    }
    t: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved rounds
        for k, fn in fns.items():
            t[k].append(fn())
    t["rebase_extra"] = [max(r - p, 1e-6) for r, p in zip(t["rebase"], t["plain"], strict=True)]
    to_plain, to_clone, to_dynamic = paired(t, "plain"), paired(t, "clone"), paired(t, "dynamic")
    roll, plain = statistics.median(t["roll"]), statistics.median(t["plain"])
    rebase, clone = statistics.median(t["rebase"]), statistics.median(t["clone"])
    extra = max(roll - plain, 1e-6)
    rows = [
        ["full prefill of W tokens (CPU time, like every row)", f"{prefill_ms:,.1f} ms", ""],
        [
            f"cache update, step with a roll of {chunk} (all layers)",
            f"{roll:.3f} ms",
            f"{prefill_ms / roll:,.0f}x below prefill",
        ],
        [
            "cache update, plain step (in place: writes the new token only)",
            f"{plain:.3f} ms",
            f"{to_dynamic['plain']:.3f}x a DynamicCache step",
        ],
        [
            "DynamicCache-style step (concatenates every layer's K and V)",
            f"{statistics.median(t['dynamic']):.3f} ms",
            "1.000x",
        ],
        ["extra work of a roll (difference)", f"{extra:.3f} ms", f"{prefill_ms / extra:,.0f}x below prefill"],
        [f"amortized per token (roll every {chunk})", f"{extra / chunk * 1e3:.2f} us", ""],
        ["plain clone of the key cache", f"{clone:.3f} ms", "1.00x"],
        [
            "cache update, step with a roll + full re-base (kept keys rotated in place)",
            f"{rebase:.3f} ms",
            f"{to_plain['rebase']:.2f}x a plain step",
        ],
        [
            "extra work of a re-base step over a plain step (difference)",
            f"{statistics.median(t['rebase_extra']):.3f} ms",
            f"{to_clone['rebase_extra']:.2f}x a clone",
        ],
    ]
    return rows


def bench_rebase(h, window: int, repeats: int) -> list[list]:
    """A full re-base pass (every key rotated by -4096) vs a plain clone, interleaved in one loop."""
    shape = (1, h.facts.num_kv_heads, window, h.facts.head_dim)
    keys = [torch.randn(shape) for _ in range(h.facts.num_layers)]
    outs = [torch.empty(shape) for _ in keys]
    own = [k.clone() for k in keys]
    fns = {
        "clone": lambda: [k.clone() for k in keys],
        "copy": lambda: [o.copy_(k) for k, o in zip(keys, outs, strict=True)],
        "new": lambda: [rotate_by(k, -4096, h.rope) for k in keys],
        "out": lambda: [rotate_by(k, -4096, h.rope, out=o) for k, o in zip(keys, outs, strict=True)],
        "inplace": lambda: [rotate_by_(k, -4096, h.rope) for k in own],
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved rounds, CPU time, median of 3 each
        for k, fn in fns.items():
            times[k].append(cpu_ms(fn))
    m = {k: statistics.median(v) for k, v in times.items()}
    ratio, to_copy = paired(times, "clone"), paired(times, "copy")
    ref = shift_keys(keys[0].double(), -4096, h.rope)
    got = rotate_by(keys[0], -4096, h.rope).double()
    rel = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    mb = sum(k.numel() * k.element_size() for k in keys) / 2**20
    c = m["clone"]
    return [
        [f"plain clone of the key cache ({mb:.0f} MiB)", f"{c:.2f} ms", "1.00x"],
        [
            "plain copy into preallocated outputs (a clone without the allocation)",
            f"{m['copy']:.2f} ms",
            f"{ratio['copy']:.2f}x a clone",
        ],
        [
            "re-base into new tensors (`rotate_by`, allocates like the clone)",
            f"{m['new']:.2f} ms",
            f"{ratio['new']:.2f}x a clone",
        ],
        [
            "re-base into preallocated outputs (`rotate_by(..., out=)`)",
            f"{m['out']:.2f} ms",
            f"{ratio['out']:.2f}x a clone; {to_copy['out']:.2f}x a preallocated copy",
        ],
        [
            "re-base in place on owned storage (`rotate_by_`)",
            f"{m['inplace']:.2f} ms",
            f"{ratio['inplace']:.2f}x a clone; {to_copy['inplace']:.2f}x a preallocated copy",
        ],
        ["max relative error per key vs the float64 reference (`shift_keys`)", f"{rel:.1e}", ""],
    ]


def bench_throughput(h, window: int, sinks: int, chunk: int, blocks: int, steps: int) -> list[list]:
    """Decode tokens/s: RollingCache (rolling every ``chunk`` tokens) vs DynamicCache at the same length.

    Between rolls the rolling cache shows ``sinks + window`` to ``sinks + window + chunk`` slots to
    attention, ``chunk / 2`` more than ``sinks + window`` on average; each DynamicCache block is
    centred on that mean (cropped back after every block), so both attend over as many keys.
    """
    dyn_start = window + sinks + chunk // 2 - steps // 2
    ids = torch.randint(100, 20000, (1, dyn_start), generator=torch.Generator().manual_seed(1))
    roll = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk)
    dyn = new_hf_cache(h.config)
    with torch.no_grad():
        h.run(ids[:, : window + sinks], roll, logits_to_keep=1)
        h.run(ids, dyn, logits_to_keep=1)
    tok = torch.tensor([[1234]])
    r_times, d_times = [], []
    with torch.no_grad():
        for _ in range(blocks):
            t0 = time.perf_counter()
            for _ in range(steps):
                h.run(tok, roll)
            r_times.append(steps / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(steps):
                h.run(tok, dyn)
            d_times.append(steps / (time.perf_counter() - t0))
            dyn.crop(-steps)  # keep the DynamicCache at the same length band
    # every block of the rolling cache covers part of a roll cycle (some hold the roll, some not):
    # tokens over the total time of all blocks counts the rolls at their true rate
    r = len(r_times) * steps / sum(steps / x for x in r_times)
    d = len(d_times) * steps / sum(steps / x for x in d_times)
    pairs = [a / b for a, b in zip(r_times, d_times, strict=True)]
    return [
        [
            f"RollingCache decode ({sinks} sinks + {window}, rolls every {chunk})",
            f"{r:.2f} tokens/s",
            f"{r / d:.3f}x (blocks of {steps}: {min(pairs):.2f}..{max(pairs):.2f})",
        ],
        [
            f"DynamicCache decode at {dyn_start}..{dyn_start + steps} tokens (the rolling cache's mean)",
            f"{d:.2f} tokens/s",
            "1.000x",
        ],
        ["rolls during the measurement", str(roll.rolls), ""],
    ]


def bench_memory(
    h,
    window: int,
    sinks: int,
    chunk: int,
    tokens: int,
    max_position: int | None,
    dyn_every: int = 2000,
    on_progress=None,
    report_every: int = 500,
) -> list[list]:
    """Generate ``tokens`` with kvlab's loop (positions chosen by the cache, re-based when needed);
    RSS sampled every 250 tokens. Every ``dyn_every`` tokens, 16 decode steps of a DynamicCache held
    at the same length (``sinks + window``) are timed next to the surrounding rolling steps."""
    cache = rolling_cache_for(h, window=window, sinks=sinks, evict_chunk=chunk, max_position=max_position)
    first = feed(h, cache, h.encode("It was a dark and stormy night; the rain fell in torrents, except at"))
    # The DynamicCache baseline lives for the whole run (allocated before the RSS baseline).
    n_dyn = sinks + window
    dyn = new_hf_cache(h.config)
    ids = torch.randint(100, 20000, (1, n_dyn), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h.run(ids, dyn, logits_to_keep=1)
    tok = torch.tensor([[1234]])

    def dyn_block(steps: int = 16) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                h.run(tok, dyn)
        dyn.crop(-steps)
        return steps / (time.perf_counter() - t0)

    samples, max_pos, rebases = [], 0, 0
    roll_rates, dyn_rates, block_t, block_n = [], [], 0.0, 0

    def summary(done: int, elapsed: float, samples: list, max_pos: int, rebases: int) -> list[list]:
        return memory_rows(
            h,
            cache,
            done,
            tokens,
            elapsed,
            samples,
            max_pos,
            rebases,
            max_position,
            roll_rates,
            dyn_rates,
            sinks + window,
        )

    t0 = time.perf_counter()
    for ev in stream_generate(h, cache, first, tokens, temperature=0.8, seed=0):
        max_pos = max(max_pos, ev.position)
        rebases += ev.rebased
        block_t += ev.seconds
        block_n += 1
        if ev.step % 250 == 0:
            samples.append((ev.step, rss_mib()))
        if (ev.step + 1) % dyn_every == 0 or ev.step + 1 == tokens:
            roll_rates.append(block_n / block_t)
            dyn_rates.append(dyn_block())
            block_t, block_n = 0.0, 0
        if on_progress and (ev.step + 1) % report_every == 0 and ev.step + 1 < tokens:
            on_progress(
                summary(
                    ev.step + 1,
                    time.perf_counter() - t0,
                    [*samples, (ev.step + 1, rss_mib())],
                    max_pos,
                    rebases,
                )
            )
    return summary(tokens, time.perf_counter() - t0, [*samples, (tokens, rss_mib())], max_pos, rebases)


def memory_rows(
    h, cache, done, tokens, elapsed, samples, max_pos, rebases, max_position, roll_rates, dyn_rates, n_dyn
) -> list[list]:
    base = [(s, r) for s, r in samples if s >= min(tokens // 5, 1000)] or [samples[-1]]
    start_rss = base[0][1]
    growth = (samples[-1][1] - start_rss) / start_rss * 100
    limit = max_position or h.max_positions
    ratios = [r / d for r, d in zip(roll_rates, dyn_rates, strict=True)] or [float("nan")]
    state = "" if done >= tokens else f" (PARTIAL: run in progress or stopped, {done:,} of {tokens:,})"
    return [
        [
            "tokens generated" + state,
            f"{done:,} in {elapsed:,.0f} s",
            f"{done / elapsed:.1f} tokens/s overall (incl. baseline blocks)",
        ],
        [
            f"RSS at token {base[0][0]:,} (after warm-up) / at the end",
            f"{start_rss:,.0f} / {samples[-1][1]:,.0f} MiB",
            f"{growth:+.2f}%",
        ],
        [
            "RSS min / max over the run (sampled every 250 tokens)",
            f"{min(r for _, r in samples):,.0f} / {max(r for _, r in samples):,.0f} MiB",
            f"first sample (token 0): {samples[0][1]:,.0f} MiB",
        ],
        ["peak RSS (ru_maxrss)", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB", ""],
        ["largest RoPE position fed", f"{max_pos:,}", f"max_position_embeddings {limit:,}"],
        ["re-bases / rolls", f"{rebases} / {cache.rolls}", ""],
        ["cache bytes at the end", f"{cache.nbytes / 2**20:.1f} MiB", f"{cache.kept} tokens kept"],
        [
            f"decode throughput, RollingCache vs DynamicCache at {n_dyn} tokens "
            f"(median of {len(ratios)} paired blocks)",
            f"{statistics.median(roll_rates or [float('nan')]):.2f} vs "
            f"{statistics.median(dyn_rates or [float('nan')]):.2f} tokens/s",
            f"{statistics.median(ratios):.3f}x (blocks: {min(ratios):.2f}..{max(ratios):.2f})",
        ],
    ]


def bench_ppl(
    h,
    books: list[str],
    windows: list[int],
    tokens: int,
    stride: int,
    methods: list[str],
    on_rows=None,
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
            print(f"  {name} W={w} ...", file=sys.stderr)
            res = streaming_perplexity(h, ids, window=w, feed=16, methods=methods, recompute_stride=stride)
            rows += [fmt_row(table_row(r)) for r in summarize(res, name, w)]
            if on_rows:
                on_rows(rows, sources)
    return rows, sources


def bench_masked(h, tokens: int, window: int, rounds: int) -> list[list]:
    """A rolling cache's per-token NLL over a stream: fed to the cache 16 tokens at a time (the reference)
    vs the masked forwards (kvlab.streaming.masked) vs one dense pass over the stream (full context),
    interleaved rounds, CPU time."""
    text = default_long_text()
    ids = h.encode(text.text[: tokens * 8])[:tokens]
    times: dict[str, list[float]] = {}
    worst = {}
    for _ in range(rounds):
        for method in ("window_abs", "sinks4"):
            got = {}
            for path in ("loop", "masked"):
                t0 = time.process_time()
                got[path] = stream_nll(h, ids, method, window=window, feed=16, path=path).nll
                times.setdefault(f"{method} {path}", []).append(time.process_time() - t0)
            worst[method] = float(np.abs(got["loop"] - got["masked"]).max())
        t0 = time.process_time()
        stream_nll(h, ids, "full", window=window, feed=16)
        times.setdefault("full", []).append(time.process_time() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    rows = [
        [f"text: {text.source} ({len(ids):,} tokens)", "", "", ""],
        [
            "one dense forward over the stream (full context, 256-token blocks)",
            f"{med['full']:.1f} s",
            "1.00x",
            "",
        ],
    ]
    for method in ("window_abs", "sinks4"):
        loop, masked = med[f"{method} loop"], med[f"{method} masked"]
        label = METHODS[method].label
        rows.append(
            [f"{label}: rolling cache fed 16 at a time", f"{loop:.1f} s", f"{loop / med['full']:.2f}x", ""]
        )
        rows.append(
            [
                f"{label}: masked forwards",
                f"{masked:.1f} s",
                f"{masked / med['full']:.2f}x ({masked / loop:.2f}x the cache)",
                f"{worst[method]:.1e}",
            ]
        )
    return rows


def fmt_row(cells: list) -> list:
    ratio = TABLE_COLUMNS.index("x re-computation (paired)")  # the acceptance figure: 3 decimals
    return [
        (f"{c:.3f}" if i == ratio else f"{c:,.2f}") if isinstance(c, float) else c
        for i, c in enumerate(cells)
    ]


def table(title: str, cols: list[str], rows: list[list]) -> str:
    out = [f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


SECTIONS = ["roll", "rebase", "throughput", "memory", "masked", "ppl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of " + ",".join(SECTIONS) + " (others keep their previous results)",
    )
    ap.add_argument("--gen-tokens", type=int, default=3000, help="tokens for the memory run (issue: 20000)")
    ap.add_argument("--mem-window", type=int, default=1020, help="window of the memory run (after the sinks)")
    ap.add_argument("--mem-sinks", type=int, default=4)
    ap.add_argument("--mem-chunk", type=int, default=64, help="eviction chunk of the memory run")
    ap.add_argument(
        "--max-position", type=int, default=None, help="override the position limit (forces re-bases)"
    )
    ap.add_argument("--tp-window", type=int, default=2048, help="window of the throughput run")
    ap.add_argument("--ppl-tokens", type=int, default=3000)
    ap.add_argument(
        "--stride", type=int, default=10, help="re-computation baseline on every STRIDE-th target >= W"
    )
    ap.add_argument(
        "--books", default="frankenstein,pride_and_prejudice", help="comma-separated shared books"
    )
    ap.add_argument("--windows", default="256,512")
    ap.add_argument("--methods", default="full,window,sinks1,sinks4,recompute")
    ap.add_argument("--skip-ppl", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sections = [x for x in args.sections.split(",") if x]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.skip_ppl and "ppl" in sections:
        sections.remove("ppl")
    h = load_model("smollm2-135m")
    q = args.quick
    t_start = time.perf_counter()
    w_roll = 256 if q else 2048

    def put(key: str, text: str) -> None:
        write_section(key, text, t_start)

    if "roll" in sections:
        print("roll cost ...", file=sys.stderr)
        put(
            "roll",
            table(
                f"Roll cost at W = {w_roll}, 4 sinks, evicting 64 at a time",
                ["what", "time", "ratio"],
                bench_roll(h, w_roll, 64, 4, 5 if q else 15),
            ),
        )
    if "rebase" in sections:
        print("re-base cost ...", file=sys.stderr)
        put(
            "rebase",
            table(
                f"Re-base pass vs clone, {h.facts.num_layers} layers x W = {w_roll}",
                ["what", "time", "ratio"],
                bench_rebase(h, w_roll, 5 if q else 15),
            )
            + REBASE_NOTE,
        )
    if "throughput" in sections:
        print("throughput ...", file=sys.stderr)
        w_tp = 256 if q else args.tp_window
        put(
            "throughput",
            table(
                f"Streaming decode throughput at W = {w_tp} (interleaved blocks)",
                ["cache", "throughput", "ratio"],
                bench_throughput(h, w_tp, 4, 64, 3 if q else 8, 16 if q else 32),
            ),
        )
    if "memory" in sections:
        print("memory ...", file=sys.stderr)
        n_gen = 300 if q else args.gen_tokens
        w, s, c = (60, 4, 16) if q else (args.mem_window, args.mem_sinks, args.mem_chunk)
        title = (
            f"Memory over {n_gen:,} generated tokens ({s} sinks + {w}, evicting {c} at a time, "
            "kvlab's loop, sampled at T=0.8)"
        )
        put(
            "memory",
            table(
                title,
                ["what", "value", ""],
                bench_memory(
                    h,
                    w,
                    s,
                    c,
                    n_gen,
                    args.max_position,
                    dyn_every=100 if q else 2000,
                    on_progress=lambda rows: put("memory", table(title, ["what", "value", ""], rows)),
                    report_every=100 if q else 500,
                ),
            ),
        )
    if "masked" in sections:
        print("masked evaluation ...", file=sys.stderr)
        n_tok, w_m = (400, 64) if q else (args.ppl_tokens, 256)
        put(
            "masked",
            table(
                f"Evaluating a rolling cache over {n_tok:,} tokens at W = {w_m} (feed 16, evict 16)",
                ["how", "CPU time", "ratio", "max NLL diff vs the cache (nats)"],
                bench_masked(h, n_tok, w_m, 1 if q else 2),
            )
            + "\nCPU time of this process, median over interleaved rounds. The masked path (`kvlab.streaming.masked`) "
            "rebuilds what the cache lets each query see as an attention mask over blocks of 256 queries "
            "(sinks re-rotated before the window, chunked eviction replayed); the last column is its largest "
            "per-token NLL difference from feeding the cache itself. `stream_nll` uses it by default.\n",
        )
    if "ppl" in sections:
        print("streaming perplexity ...", file=sys.stderr)
        n_tok = 400 if q else args.ppl_tokens
        windows = [128] if q else [int(x) for x in args.windows.split(",")]
        stride = args.stride

        def ppl_text(rows: list[list], sources: list[str]) -> str:
            return (
                table(
                    f"Streaming perplexity, {n_tok:,} tokens per book (feed 16, evict 16)",
                    TABLE_COLUMNS,
                    rows,
                )
                + f"\nSources: {', '.join(sources)}. 're-computed' = sliding window with re-computation "
                f"(each target predicted by a fresh prefill of its W previous tokens), evaluated on every "
                f"{stride}th target from W on; 'ppl (subsample)' and 'x re-computation (paired)' score "
                "every method on exactly those targets (paired ratio = exp of the mean NLL difference, "
                "bootstrap 95% CI over targets). 'ppl (all targets)' is over every target 1..N-1. "
                "'seconds' is the wall time of the method (re-computation: the subsample only).\n"
            )

        bench_ppl(
            h,
            args.books.split(","),
            windows,
            n_tok,
            stride,
            args.methods.split(","),
            on_rows=lambda rows, sources: put(
                f"ppl_{'_'.join(args.books.split(','))}", ppl_text(rows, sources)
            ),
        )


REBASE_NOTE = (
    "\nA re-base rotates every cached key by one scalar shift: cos/sin of the shift computed once per "
    "re-base in float64 (one `[head_dim/2]` pair), the multiply-adds in fp32 with preallocated outputs, "
    "chunked over tokens (three kernels per chunk out of place, five in place) (`kvlab.rope.fast`). The RollingCache writes "
    "it straight into the buffer its step allocates anyway (row 'extra work of a re-base step' of the "
    "roll table). Times: CPU time of this process (user + system, so the page faults of fresh "
    "allocations count), median over interleaved rounds of the median of 3 calls; ratios: median of "
    "the per-round ratios (each round measured side by side).\n"
)


def write_section(key: str, body: str, t_start: float) -> None:
    """Replace section ``key`` of ``results/rolling.md`` (other sections keep their previous run)."""
    cmd = "python3 " + " ".join([sys.argv[0].split("/work/main/")[-1], *sys.argv[1:]])
    stamp = (
        f"_`{cmd}` — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, torch "
        f"{torch.__version__} with {torch.get_num_threads()} thread(s), {platform.machine()}, "
        f"SmolLM2-135M fp32, {time.perf_counter() - t_start:.0f} s into the run._\n\n"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(
        f"/tmp/kvlab-rolling-{os.getuid()}.lock", "w"
    ) as lock:  # several runs may write their sections at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = RESULTS.read_text() if RESULTS.is_file() else ""
        found = dict(re.findall(r"<!-- section: (\w+) -->\n(.*?)(?=<!-- section: |\Z)", old, flags=re.S))
        found[key] = stamp + body.rstrip() + "\n\n"
        order = sorted(found, key=lambda k: (SECTIONS.index(k.split("_")[0]), k))
        write_page(RESULTS, header() + "".join(f"<!-- section: {k} -->\n{found[k]}" for k in order))
    print(stamp + body)


def header() -> str:
    return (
        "# Rolling cache benchmark\n\n`benchmarks/rolling.py`; each section is written by the run named "
        "in its first line (sections can be re-run alone with `--sections`; the perplexity table has one "
        "section per run of `--books`). Shared machine: ratios are measured side by side in one run; "
        "absolute times are indicative only.\n\n"
    )


if __name__ == "__main__":
    main()
