"""Fuzzing the snapshot loader: thousands of mutated files, each must be refused or load identically.

Two small saved snapshots (fp32 prefill, and a bf16 "edited" copy) are mutated at random by
``kvlab.cache._fuzz.mutate``: bit flips anywhere, printable bytes written into the header,
truncations, appended bytes, edits of one metadata field with the digest left stale, and forged
files whose digest is recomputed over an invalid schema (int8/int64/mixed dtypes, NaN/inf, negative
or float positions, out-of-vocabulary or negative ids, empty cache, missing/extra tensors, shapes or
geometry that disagree, a "prefill" with gapped positions, a bad RoPE spec or provenance). Every
load runs under a 10-second alarm. Outcomes: refused with a kvlab error, loaded identical (e.g. a
whitespace change in the JSON header), loaded with DIFFERENT content, CRASH (another exception), HANG.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import tempfile
import time
from pathlib import Path

import torch

from _common import write_results
from kvlab.cache import _fuzz as F

OUTCOMES = ("rejected", "identical", "DIFFERENT", "CRASH", "HANG")


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mutations", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.mutations < 1:
        parser.error("--mutations must be >= 1")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    bases = {"fp32 prefill": F.small_snapshot(seed=1)}
    bases["bf16 edited"] = F.small_snapshot(seed=2, layers=3, tokens=9).to(dtype=torch.bfloat16)
    files = {name: F.save_snapshot_bytes(s) for name, s in bases.items()}
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    crashes: collections.Counter = collections.Counter()
    signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.kv.safetensors"
        for i in range(args.mutations):
            name = list(bases)[i % len(bases)]
            snap, data = bases[name], files[name]
            kind, mutated = F.mutate(data, rng, snap)
            if kind not in ("bit flip", "header byte", "truncation", "appended bytes", "header field edit"):
                kind = f"forged: {kind}"
            path.write_bytes(mutated)
            signal.alarm(10)
            try:
                out = F.outcome(path, snap)
            except _Hang:
                out = "HANG"
            finally:
                signal.alarm(0)
            if out.startswith("CRASH"):
                crashes[out] += 1
                out = "CRASH"
            counts[kind][out] += 1
    elapsed = time.perf_counter() - t0
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    lines = [
        f"{args.mutations:,} mutations (seed {args.seed}) of two small snapshot files "
        f"({', '.join(f'{n}: {len(b):,} bytes' for n, b in files.items())}), loaded with "
        f"`load_snapshot(path, expect_vocab_size={F.VOCAB})`; {elapsed:.1f} s in all.",
        "",
        "| mutation | tried | " + " | ".join(OUTCOMES) + " |",
        "|---|---|" + "---|" * len(OUTCOMES),
    ]
    order = ["bit flip", "header byte", "truncation", "appended bytes", "header field edit"]
    for kind in order + sorted(k for k in counts if k not in order):
        c = counts[kind]
        lines.append(f"| {kind} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    lines.append(
        f"| **all** | **{sum(total.values())}** | " + " | ".join(f"**{total[o]}**" for o in OUTCOMES) + " |"
    )
    lines += [
        "",
        "Acceptance (issue 12): 0 DIFFERENT, 0 CRASH, 0 HANG"
        + (" — met." if not (total["DIFFERENT"] or total["CRASH"] or total["HANG"]) else " — NOT met."),
    ]
    if crashes:
        lines.append("Crashes: " + ", ".join(f"{k} x{v}" for k, v in crashes.items()))
    lines += [
        "",
        "Not covered, by construction: a forger who writes *valid-looking* metadata and tensors and "
        "recomputes the digest produces a file nothing inside it can tell from a genuine one (the digest "
        "is not a signature); `load_snapshot(path, model=handle)` still refuses it when its geometry, "
        "dtype, RoPE or ids do not fit the model. See docs/snapshots.md.",
    ]
    write_results("fuzz_snapshot", "Snapshot loader fuzz", "\n".join(lines))
    if total["DIFFERENT"] or total["CRASH"] or total["HANG"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
