"""Peak memory and time of a decode step with a compressed cache already built (issue 15, item 2).

Each configuration runs in its own fresh process: load the bundled model, build the cache by feeding
``--tokens`` tokens in chunks of 512 (so prefill activations stay small), then reset the process's
peak-RSS mark (``/proc/self/clear_refs``) and decode ``--steps`` tokens. glibc is told to serve every
allocation of 64 KiB or more with its own mapping, returned on free (``MALLOC_MMAP_THRESHOLD_``), so
the resident set follows live tensors and its peak is the step's true peak (nothing hides in freed
heap); that setting makes each step page-fault its fresh buffers, so the step time is measured in a
second fresh process with the default allocator. Memory is reported above the process's resident set before the cache was built (model,
libraries, after one warm-up forward): cache + whatever the step allocates.

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

CONFIGS = {
    "full precision (DynamicCache)": None,
    "rotation+sinks int4": ("rotation", {"sinks": 4}),
    "kivi+sinks int4": ("kivi", {"sinks": 4}),
}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(name: str, tokens: int, steps: int) -> dict:
    import torch

    from kvlab import load_model
    from kvlab.compress.quant import make_quantizer
    from kvlab.data import default_long_text
    from kvlab.hf import new_hf_cache
    from kvlab.hf.compressed_cache import CompressedCache

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    h = load_model("smollm2-135m")
    text = default_long_text()
    ids = h.encode(text.text[: tokens * 8])
    while len(ids) < tokens + steps:  # repeat a short text to reach the length
        ids = ids + ids
    ids = torch.tensor([ids[: tokens + steps]])
    spec = CONFIGS[name]
    cache = (
        new_hf_cache(h.config)
        if spec is None
        else CompressedCache(h.config, quantizer=make_quantizer(spec[0], 4, **spec[1]))
    )
    with torch.no_grad():  # warm-up: the weights (mapped from disk) and the libraries' first-use memory
        h.run(ids[:, :512], new_hf_cache(h.config), logits_to_keep=1)
    gc.collect()
    before = _kib("VmRSS")
    with torch.no_grad():
        for start in range(0, tokens, 512):
            h.run(ids[:, start : min(start + 512, tokens)], cache, logits_to_keep=1)
        built = _kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            h.run(ids[:, tokens + i : tokens + i + 1], cache, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
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
        "step_ms": sorted(times)[len(times) // 2] * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.steps)))
        return
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # Memory: glibc returns every allocation >= 64 KiB, so the peak follows live tensors (but every step
    # then page-faults its fresh buffers, which slows it). Time: a second fresh process, default allocator.
    memory_env = {**os.environ, **threads, "MALLOC_MMAP_THRESHOLD_": "65536"}
    time_env = {k: v for k, v in {**os.environ, **threads}.items() if not k.startswith("MALLOC_")}
    rows = []
    for name in CONFIGS:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--tokens",
            str(args.tokens),
            "--steps",
            str(args.steps),
        ]
        mem, timed = (
            json.loads(
                subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[
                    -1
                ]
            )
            for env in (memory_env, time_env)
        )
        rows.append({**mem, "step_ms": timed["step_ms"]})
    full = rows[0]
    lines = [
        f"Cache of {args.tokens:,} tokens ({rows[0]['text']}, repeated if shorter) built in chunks of 512, "
        f"then {args.steps} decode steps; each configuration in two fresh processes (memory, then time), 1 torch thread.",
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
        "tensors; the step time comes from a second process with glibc's default allocator. A quantized layer is dequantized for its own attention only (one layer's full-precision K/V "
        "at a time, freed before the next layer), so the step's peak stays near the packed size; the time is "
        "that dequantization, repeated over the whole history at every step.",
    ]
    from _common import write_results

    write_results("compressed_decode", "Compressed decode: peak memory and time of a step", "\n".join(lines))


if __name__ == "__main__":
    main()
