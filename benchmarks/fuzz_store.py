"""Fuzz the KV store's on-disk blocks: random mutations must be refused or read back identical.

Each mutation is written over one block file of a real 3-block chain in a disk store, then read back
through ``decode_block`` (what ``store get`` / ``verify`` use) and through a lookup by a fresh store
(the direct read path). Outcomes: refused (error or miss), identical, DIFFERENT (wrong data served:
must be 0), CRASH (a non-kvlab exception: must be 0). Hangs are caught by a per-read alarm.

    python benchmarks/fuzz_store.py --mutations 6000
"""

from __future__ import annotations

import argparse
import collections
import logging
import platform
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _common import write_page  # noqa: E402
from kvlab.store import KVStore  # noqa: E402
from kvlab.store._fuzz import (  # noqa: E402
    CRASH,
    DIFFERENT,
    KINDS,
    classify_decode,
    classify_lookup,
    encoded,
    make_sample,
    mutate,
)
from kvlab.store.disk import DiskTier  # noqa: E402
from kvlab.store.memory import MemoryTier  # noqa: E402


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutations", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz_store.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("kvlab").setLevel(
        logging.ERROR
    )  # each refused block logs a warning; count them instead
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(args.seed)
    sample = make_sample(args.seed)
    blobs = encoded(sample)
    counts: dict[tuple[str, str, str], int] = collections.Counter()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskTier(Path(tmp) / "store")
        for b in sample.blocks:
            disk.put(b)
        paths = [disk._path(b.parent, b.hash) for b in sample.blocks]
        for _ in range(args.mutations):
            j = rng.randrange(len(blobs))
            kind, data = mutate(blobs[j], rng, blobs[(j + 1) % len(blobs)])
            for path, blob in zip(paths, blobs, strict=True):  # restore the chain, then damage one block
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(blob)
            paths[j].write_bytes(data)
            for reader in ("decode", "lookup"):
                signal.alarm(10)
                try:
                    if reader == "decode":
                        outcome = classify_decode(data, sample.blocks[j])
                    else:
                        store = KVStore(
                            [MemoryTier(), DiskTier(Path(tmp) / "store", create=False)], block_tokens=4
                        )
                        outcome = classify_lookup(store, sample, j)
                except Hang:
                    outcome = "HANG"
                finally:
                    signal.alarm(0)
                counts[(kind, reader, outcome)] += 1
    seconds = time.perf_counter() - started
    outcomes = ["refused", "identical", DIFFERENT, CRASH, "HANG"]
    lines = [
        "## KV store block fuzz",
        "",
        f"Command: `python benchmarks/fuzz_store.py --mutations {args.mutations} --seed {args.seed}` · machine: {_machine()} · "
        f"date: {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{args.mutations:,} mutations (seed {args.seed}) of one block file in a real 3-block chain on disk, each read "
        f"back by `decode_block` and by a lookup from a fresh store; {seconds:.1f} s in all. 'refused' means a "
        "clean kvlab error or a miss (the lookup then serves only the intact blocks before the damaged one, "
        "checked bit-exact); 'identical' means every byte that matters was unchanged.",
        "",
        "| mutation | reader | tried | " + " | ".join(outcomes) + " |",
        "|---|---|---|" + "---|" * len(outcomes),
    ]
    total = collections.Counter()
    for kind in KINDS:
        for reader in ("decode", "lookup"):
            row = [counts[(kind, reader, o)] for o in outcomes]
            for o, n in zip(outcomes, row, strict=True):
                total[o] += n
            lines.append(f"| {kind} | {reader} | {sum(row):,} | " + " | ".join(f"{n:,}" for n in row) + " |")
    lines.append(
        f"| **all** | both | {sum(total.values()):,} | "
        + " | ".join(f"**{total[o]:,}**" for o in outcomes)
        + " |"
    )
    bad = total[DIFFERENT] + total[CRASH] + total["HANG"]
    lines += ["", f"Wrong data served, non-kvlab exceptions and hangs: **{bad}**.", ""]
    write_page(args.out, "\n".join(lines))
    print("\n".join(lines))
    return 1 if bad else 0


def _machine() -> str:
    import os

    return f"{os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__} with 1 thread, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
