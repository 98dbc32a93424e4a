"""Peak memory and time of a decode step with a compressed cache already built (issue 15, item 2).

Each configuration runs in its own fresh process: load the bundled model, build the cache by feeding
``--tokens`` tokens in chunks of 512 (so prefill activations stay small), then reset the process's
peak-RSS mark (``/proc/self/clear_refs``) and decode ``--steps`` tokens. glibc is told to serve every
allocation of 64 KiB or more with its own mapping, returned on free (``MALLOC_MMAP_THRESHOLD_``), so
the resident set follows live tensors and its peak is the step's true peak (nothing hides in freed
heap); that setting makes each step page-fault its fresh buffers, so step times are measured in one
more fresh process with the default allocator, holding every configuration's cache and taking their
steps in turn (side by side). Memory is reported above the process's resident set before the cache
was built (model, libraries, after one warm-up forward): cache + whatever the step allocates.

    OMP_NUM_THREADS=1 python3 benchmarks/compressed_decode.py [--tokens 8192] [--steps 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name -> (quantizer, options, bind the cache to the model); a bound quantizing cache decodes on its
# packed codes (kvlab.kernels.quant_attention), an unbound one decodes its history and runs SDPA.
CONFIGS = {
    "full precision (DynamicCache)": None,
    "rotation+sinks int4, packed-code attention": ("rotation", {"sinks": 4}, True),
    "rotation+sinks int4, decode + SDPA (reference)": ("rotation", {"sinks": 4}, False),
    "kivi+sinks int4, packed-code attention": ("kivi", {"sinks": 4}, True),
    "kivi+sinks int4, decode + SDPA (reference)": ("kivi", {"sinks": 4}, False),
}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _setup(tokens: int, steps: int):
    import torch

    from kvlab import load_model
    from kvlab.data import default_long_text

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    h = load_model("smollm2-135m")
    text = default_long_text()
    ids = h.encode(text.text[: tokens * 8])
    while len(ids) < tokens + steps + 1:  # repeat a short text to reach the length
        ids = ids + ids
    return h, text, torch.tensor([ids[: tokens + steps + 1]])


def _new_cache(h, name: str):
    from kvlab.hf import new_hf_cache
    from kvlab.hf.compressed_cache import CompressedCache
    from kvlab.policy.quant import make_quantizer

    spec = CONFIGS[name]
    if spec is None:
        return new_hf_cache(h.config)
    return CompressedCache(
        h.config, quantizer=make_quantizer(spec[0], 4, **spec[1]), model=h.model if spec[2] else None
    )


def _build(h, cache, ids, tokens: int) -> None:
    """Feed ``tokens`` tokens in chunks of 512, then one untimed decode step (kernel plans, first use)."""
    for start in range(0, tokens, 512):
        h.run(ids[:, start : min(start + 512, tokens)], cache, logits_to_keep=1)
    h.run(ids[:, tokens : tokens + 1], cache, logits_to_keep=1)


def memory_child(name: str, tokens: int, steps: int) -> dict:
    import torch

    from kvlab.hf import new_hf_cache
    from kvlab.hf.compressed_cache import CompressedCache

    h, text, ids = _setup(tokens, steps)
    cache = _new_cache(h, name)
    with torch.no_grad():  # warm-up: the weights (mapped from disk) and the libraries' first-use memory
        h.run(ids[:, :512], new_hf_cache(h.config), logits_to_keep=1)
    gc.collect()
    before = _kib("VmRSS")
    with torch.no_grad():
        _build(h, cache, ids, tokens)
        built = _kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        for i in range(steps):
            h.run(ids[:, tokens + 1 + i : tokens + 2 + i], cache, logits_to_keep=1)
        peak = _kib("VmHWM")
    held = (
        cache.nbytes
        if isinstance(cache, CompressedCache)
        else sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    )
    return {
        "name": name,
        "text": text.source,
        "cache_mib": held / 2**20,
        "built_mib": (built - before) / 1024,
        "peak_mib": (peak - before) / 1024,
    }


def time_child(tokens: int, steps: int) -> dict:
    """Every configuration's cache in one process, then their decode steps interleaved (round-robin),
    so each ratio compares steps taken side by side under the same machine state."""
    import torch

    h, _, ids = _setup(tokens, steps)
    caches = {name: _new_cache(h, name) for name in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with torch.no_grad():
        for cache in caches.values():
            _build(h, cache, ids, tokens)
        for i in range(steps):
            tok = ids[:, tokens + 1 + i : tokens + 2 + i]
            for name, cache in caches.items():
                t0 = time.perf_counter()
                h.run(tok, cache, logits_to_keep=1)
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[len(t) // 2] * 1000 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--time-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(memory_child(args.child, args.tokens, args.steps)))
        return
    if args.time_child:
        print(json.dumps(time_child(args.tokens, args.steps)))
        return
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Memory: glibc returns every allocation >= 64 KiB, so the peak follows live tensors (but every step
    # then page-faults its fresh buffers, which slows it). Time: a second fresh process, default allocator.
    memory_env = {**os.environ, **threads, "MALLOC_MMAP_THRESHOLD_": "65536"}
    time_env = {k: v for k, v in {**os.environ, **threads}.items() if not k.startswith("MALLOC_")}
    size = ["--tokens", str(args.tokens), "--steps", str(args.steps)]

    def run(extra: list[str], env: dict) -> dict:
        out = subprocess.run(
            [sys.executable, __file__, *extra, *size], env=env, capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"child {extra} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.splitlines()[-1])

    rows = []
    for name in CONFIGS:
        print(f"  memory: {name} ...", file=sys.stderr, flush=True)
        rows.append(run(["--child", name], memory_env))
    print("  time: every configuration in one process, steps interleaved ...", file=sys.stderr, flush=True)
    step_ms = run(["--time-child"], time_env)
    for r in rows:
        r["step_ms"] = step_ms[r["name"]]
    full = rows[0]
    lines = [
        f"Cache of {args.tokens:,} tokens ({rows[0]['text']}, repeated if shorter) built in chunks of 512, "
        f"then one untimed decode step and {args.steps} timed ones, 1 torch thread. Memory: each configuration "
        "in its own fresh process. Time: every configuration's cache in one process, their steps interleaved "
        "round-robin (so each ratio is side by side), median step.",
        "",
        "| cache | K/V held | resident after building | peak during a decode step | peak vs full precision | "
        "decode step (median) | vs full precision |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['cache_mib']:.1f} MiB | {r['built_mib']:.1f} MiB | {r['peak_mib']:.1f} MiB | "
            f"{r['peak_mib'] / full['peak_mib']:.2f}x | {r['step_ms']:.1f} ms | {r['step_ms'] / full['step_ms']:.2f}x |"
        )
    lines += [
        "",
        "Memory is above the process's resident set before the cache was built (model weights and libraries "
        "excluded), with glibc returning every allocation of 64 KiB or more on free, so the peak follows live "
        "tensors; the step times come from one more process with glibc's default allocator. "
        "Packed-code attention (a cache built with model=): each layer's decode query reads the codes in a "
        "C kernel (rotation: rotate the query, not the keys, one decoded row at a time; KIVI: per-channel "
        "keys read one token group at a time with a scaled query, per-token values with their zero "
        "points), so no full-precision copy of the history exists. Decode + SDPA (the same cache without "
        "model=): each layer's history is dequantized for its own attention only (one layer's "
        "full-precision K/V at a time), repeated over the whole history at every step.",
    ]
    from _common import write_results

    write_results("compressed_decode", "Compressed decode: peak memory and time of a step", "\n".join(lines))


if __name__ == "__main__":
    main()
