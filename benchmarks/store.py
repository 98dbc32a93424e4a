"""Benchmark: time to first token with a stored 2,000-token prefix vs a full prefill, and disk-tier
load speed vs a plain sequential read of the same bytes. All series are measured side by side, in
one run, interleaved, and reported as ratios.

Run: OMP_NUM_THREADS=1 python3 benchmarks/store.py [--prefix-tokens 2000] [--reps 3] [--redis URL]
Writes benchmarks/results/store.md. Uses a local redis-server when one can be started (or --redis).
``--no-ttft`` skips the time-to-first-token series (for quick runs of the load comparison only).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import write_page
from kvlab import load_model
from kvlab.data import default_long_text
from kvlab.store import DiskTier, KVStore, MemoryTier, chain_hashes, prefill_with_store
from kvlab.store.store import _alloc

HERE = Path(__file__).resolve().parent
QUESTIONS = [
    f"\n\nQuestion {i}: what happens next in the passage above, and why?\nAnswer:" for i in range(12)
]


def _start_redis() -> tuple[subprocess.Popen | None, str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def _drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget these files' cached pages (no root needed for clean pages)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_read(paths: list[Path]) -> int:
    """Read each file whole and drop it (the buffer is reused, so it stays in the CPU cache)."""
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def _plain_read_kept(paths: list[Path], sizes: list[int]) -> torch.Tensor:
    """Read the files, in order, into one new buffer that is kept, as any loader that returns the data must.

    The buffer comes from the store's own allocator (``torch.empty``), so the plain reader and the store
    pay the same page faults for fresh memory.
    """
    out = _alloc((sum(sizes),), torch.uint8)
    view = memoryview(out.numpy())
    at = 0
    for p, n in zip(paths, sizes, strict=True):
        with open(p, "rb", buffering=0) as f:
            got = f.readinto(view[at : at + n])
        assert got == n, (p, got, n)
        at += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3, help="full prefills (hits get 2x as many)")
    ap.add_argument("--load-reps", type=int, default=7)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--redis", default=os.environ.get("KVLAB_REDIS_URL"))
    ap.add_argument("--no-ttft", action="store_true", help="only the disk load comparison")
    args = ap.parse_args()
    torch.set_num_threads(1)

    h = load_model("smollm2-135m")
    text = default_long_text()
    prefix = h.encode(text.text[: args.prefix_tokens * 8])[: args.prefix_tokens]
    questions = [h.encode(q) for q in QUESTIONS]
    tmp = Path(tempfile.mkdtemp(prefix="kvlab-bench-store-"))
    proc, redis_url = (None, args.redis) if args.redis else _start_redis()
    try:
        stores = {
            "memory": KVStore([MemoryTier()], block_tokens=args.block_tokens),
            "disk": KVStore([DiskTier(tmp / "disk")], block_tokens=args.block_tokens),
        }
        if redis_url:
            from kvlab.store.redis_tier import RedisTier

            stores["redis"] = KVStore(
                [RedisTier(redis_url, prefix=f"kvlab-bench-{os.getpid()}")], block_tokens=args.block_tokens
            )
        h.prefill(prefix[:32], all_logits=False)  # warm-up
        base = h.prefill(prefix, all_logits=False).snapshot
        for st in stores.values():
            st.put(base)

        # 1. TTFT, interleaved: full prefill, then one hit from every tier, repeated.
        ttft: dict[str, list[float]] = {"full": [], **{k: [] for k in stores}}
        max_err = 0.0
        for r in range(0 if args.no_ttft else args.reps):
            prompt = prefix + questions[r % len(questions)]
            t0 = time.perf_counter()
            full = h.prefill(prompt, all_logits=False)
            ttft["full"].append((time.perf_counter() - t0) * 1000)
            for rr in range(2):
                for name, st in stores.items():
                    p = prefix + questions[(r + rr * args.reps) % len(questions)]
                    pre = prefill_with_store(h, st, p, store_prompt=False)
                    assert pre.cached_tokens == len(prefix), (name, pre.cached_tokens)
                    ttft[name].append(pre.ttft_ms)
                    if rr == 0:
                        max_err = max(max_err, float((pre.last_logits - full.logits[-1]).abs().max()))

        # 2. Disk tier load (read + checksum + assemble) vs a plain sequential read of the same files.
        disk_store = stores["disk"]
        ns = disk_store.namespace(h)
        tier = disk_store.tiers[0]
        paths = [
            tier._path(p, c)
            for p, c in zip([ns.root, *chain_hashes(prefix, ns)], chain_hashes(prefix, ns), strict=False)
        ]
        paths = [p for p in paths if p.is_file()]
        sizes = [p.stat().st_size for p in paths]
        kinds = ("plain", "kept", "store")
        loads: dict[str, list[float]] = {f"{t}_{k}": [] for t in ("warm", "cold") for k in kinds}
        usable = len(prefix) - len(prefix) % args.block_tokens
        for rep in range(args.load_reps):
            for temp in ("warm", "cold"):
                for kind in kinds[rep % 3 :] + kinds[: rep % 3]:  # rotate the order between repetitions
                    if temp == "cold":
                        _drop_page_cache(paths)
                    t0 = time.perf_counter()
                    if kind == "plain":
                        _plain_read(paths)
                    elif kind == "kept":
                        kept = _plain_read_kept(paths, sizes)
                    else:
                        m = disk_store.lookup(prefix, ns, max_tokens=usable)
                    loads[f"{temp}_{kind}"].append(time.perf_counter() - t0)
                    if kind == "store":
                        assert m.snapshot is not None and m.cached_tokens == usable, m.cached_tokens
                        del m
                    elif kind == "kept":
                        del kept
        corrupt = tier.counters.corrupt
    finally:
        if redis_url and "redis" in locals().get("stores", {}):
            t = stores["redis"].tiers[0]
            keys = list(t.client.scan_iter(f"{t.prefix}:*"))
            if keys:
                t.client.delete(*keys)
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in ttft.items() if v}
    lmed = {k: statistics.median(v) for k, v in loads.items()}
    mb = sum(sizes) / 2**20
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_avg = os.getloadavg()[0]
    lines = [
        "# KV store benchmark",
        "",
        f"Command: `python3 {' '.join(sys.argv)}`  ",
        f"Machine: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average {load_avg:.1f} at the end; {now}.  ",
        f"Model: {h.name} fp32; prefix {len(prefix)} tokens of {text.source}; {args.block_tokens}-token blocks; "
        f"cache {base.nbytes / 2**20:.1f} MiB.",
        "",
    ]
    if med:
        lines += [
            "## Time to first token with a cached prefix (median ms; ratio = full prefill / hit)",
            "",
            "| source | runs | TTFT ms (median) | min | max | speed-up vs full prefill |",
            "|---|---|---|---|---|---|",
        ]
        for k, v in ttft.items():
            lines.append(
                f"| {'full prefill' if k == 'full' else k + ' hit'} | {len(v)} | {med[k]:.1f} | {min(v):.1f} | "
                f"{max(v):.1f} | {med['full'] / med[k]:.1f}x |"
            )
        lines += [
            "",
            f"Target: >= 10x for memory and disk. Reused logits vs full prefill: max abs difference {max_err:.2e}.",
            "" if redis_url else "Redis: not measured (no redis-server binary and no --redis).",
            "",
        ]
    lines += [
        f"## Disk tier load vs plain sequential read of the same {len(paths)} files ({mb:.1f} MiB), "
        f"median of {args.load_reps}, interleaved",
        "",
        "| page cache | plain read, dropped MiB/s | plain read, kept MiB/s | store load MiB/s "
        "(read + XXH3 check + assemble) | store / plain dropped | store / plain kept |",
        "|---|---|---|---|---|---|",
    ]
    for temp in ("warm", "cold"):
        plain, kept_s = mb / lmed[f"{temp}_plain"], mb / lmed[f"{temp}_kept"]
        store = mb / lmed[f"{temp}_store"]
        lines.append(
            f"| {temp} | {plain:.0f} | {kept_s:.0f} | {store:.0f} | {store / plain:.2f}x | {store / kept_s:.2f}x |"
        )
    lines += [
        "",
        f"Target: store / plain >= 0.5x. Blocks failing their checksum during the run: {corrupt}.",
        "",
        "- *store load*: `KVStore.lookup` of the prefix from a disk-only store: plan the chain, read every block "
        "straight into its slice of freshly allocated K and V (`preadv`), check its XXH3-64 checksum over the bytes "
        "where they landed, and build the snapshot.",
        "- *plain read, dropped*: `open(p).read()` of each file, the result thrown away; the reused buffer stays in "
        "the CPU cache, so nothing is written to main memory.",
        "- *plain read, kept*: the same files read into one new buffer that is kept (allocated like the store's "
        "output, `torch.empty`). Any loader that returns the bytes pays for writing them to fresh "
        "memory; this is the plain read that does the same job as the store minus the checks and the scatter.",
        "- *cold* evicts the files from the page cache (posix_fadvise DONTNEED) before each read, so all three read "
        "from the device; *warm* reads from the page cache.",
        "",
    ]
    out = "\n".join(lines)
    print(out)
    write_page(HERE / "results" / "store.md", out)


if __name__ == "__main__":
    main()
