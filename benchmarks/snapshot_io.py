"""Snapshot save/load throughput vs a plain copy of the same bytes, measured side by side.

A 2,048-token cache of the bundled model (fp32: 2,048 x 46,080 B = 94 MB) is saved with
``save_snapshot`` (safetensors + sha256 + fsync + atomic rename) and loaded with ``load_snapshot``
(checksum verified, and without verification), against ``shutil.copyfile`` of the saved file plus
an fsync (the same bytes, the same disk) and a plain read of it. Best of N runs each, interleaved.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from _common import write_results
from kvlab import load_model
from kvlab.cache import load_snapshot, save_snapshot


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    handle = load_model("smollm2-135m")
    ids = torch.randint(100, 40_000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    snap = handle.prefill(ids, all_logits=False).snapshot
    mb = snap.nbytes / 1e6
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVLAB_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        path = tmp / "a.kv.safetensors"
        save_snapshot(snap, path)
        file_mb = path.stat().st_size / 1e6

        def plain_copy():
            shutil.copyfile(path, tmp / "copy.bin")
            fd = os.open(tmp / "copy.bin", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        def plain_read():
            (tmp / "copy.bin").read_bytes()

        rows = {
            "save_snapshot (sha256 + fsync + rename)": lambda: save_snapshot(snap, path),
            "plain copy of the file (+ fsync)": plain_copy,
            "load_snapshot (checksum verified)": lambda: load_snapshot(path),
            "load_snapshot (verify=False, lazy mmap; bytes read on use)": lambda: load_snapshot(
                path, verify=False
            ),
            "plain read of the file": plain_read,
        }
        plain_copy()
        timings = {name: best(fn, args.repeats) for name, fn in rows.items()}
    copy_s, read_s = timings["plain copy of the file (+ fsync)"], timings["plain read of the file"]
    lines = [
        f"Cache: {args.tokens} tokens of SmolLM2-135M fp32 = {mb:.1f} MB of K/V ({file_mb:.1f} MB file). "
        f"Best of {args.repeats}.",
        "",
        "| operation | seconds | MB/s | vs plain copy/read |",
        "|---|---|---|---|",
    ]
    for name, s in timings.items():
        ref = copy_s if name.startswith(("save", "plain copy")) else read_s
        lines.append(f"| {name} | {s:.3f} | {file_mb / s:,.0f} | {ref / s:.2f}x |")
    write_results("snapshot_io", "Snapshot save/load throughput", "\n".join(lines))


if __name__ == "__main__":
    main()
