"""Soak: 4 processes share one store (disk + Redis) while a killer SIGKILLs them mid-operation.

Every process puts and looks up prefixes of a few token sequences whose K/V are a known function of
the tokens (a prefix cache: slot t depends on tokens 0..t only), so any torn, mixed or misfiled block
would show up as wrong data. Bounded by work, not by the clock, so a loaded machine makes it slower but
never changes its outcome: it runs until the workers did ``KVLAB_SOAK_OPS`` operations (default 10,000)
and the killer killed ``KVLAB_SOAK_KILLS`` of them (default 16). A worker is killed only once it is
ready (its imports done, its store open) and has done a random number of operations since, so every
kill lands mid-put or mid-lookup, never mid-import; the deadlines are on progress (a worker that never
gets ready, minutes without an operation finishing), not on the run's length.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

LAYERS, HEADS, DIM, BLOCK = 2, 2, 8, 8
SEQUENCES = [[(7 * s + 3 * i) % 997 + 1 for i in range(64)] for s in range(4)]
FINGERPRINT = "5" * 64


def expected(ids: list[int]):
    """K/V of a prefix cache of ``ids``: slot t is a function of tokens 0..t (a prefix property)."""
    t = torch.tensor(ids, dtype=torch.float64)
    base = (torch.cumsum(t, 0) % 9973) / 9973.0  # [T]
    grid = torch.arange(LAYERS * HEADS * DIM, dtype=torch.float64).reshape(LAYERS, HEADS, 1, DIM) / 100
    k = (base.reshape(1, 1, -1, 1) + grid).float()
    return k, (k * 2 + 1)


def snapshot(ids: list[int]):
    from kvlab.cache.snapshot import KVSnapshot

    k, v = expected(ids)
    return KVSnapshot(
        keys=tuple(k[i].unsqueeze(0) for i in range(LAYERS)),
        values=tuple(v[i].unsqueeze(0) for i in range(LAYERS)),
        token_ids=torch.tensor([ids]),
        positions=torch.arange(len(ids)),
        rope=None,
        fingerprint=FINGERPRINT,
        model_name="soak",
        provenance="prefill",
    )


#: Each worker's counters, in shared memory without a lock (one writer each, and a lock held by a killed
#: worker would stall everyone): ready (imports done, store open), puts, lookups, served tokens, wrong.
READY, PUTS, LOOKUPS, SERVED, WRONG = range(5)
#: Progress deadlines, not run-length ones: a worker's start-up (spawn, torch and kvlab imports, store
#: open) on a badly loaded machine, and the longest a worker may go without finishing one operation.
START_S, STALL_S = 600.0, 180.0


def _worker(root: str, redis_url: str, prefix: str, seed: int, counts, stop) -> None:
    import logging

    from kvlab.store import KVStore
    from kvlab.store.disk import DiskTier
    from kvlab.store.memory import MemoryTier
    from kvlab.store.redis_tier import RedisTier

    logging.getLogger("kvlab").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rng = random.Random(seed)
    st = KVStore(
        [MemoryTier(2**20), DiskTier(root, create=False), RedisTier(redis_url, prefix=prefix)],
        block_tokens=BLOCK,
    )
    ns = st.namespace(snapshot(SEQUENCES[0][:BLOCK]))
    counts[READY] = 1
    while not stop.value:
        ids = rng.choice(SEQUENCES)[: rng.randint(BLOCK, 64)]
        if rng.random() < 0.4:
            st.put(snapshot(ids))
            counts[PUTS] += 1
            continue
        m = st.lookup(ids, ns)
        if m.snapshot is not None:
            k, v = expected(ids[: m.cached_tokens])
            got_k = torch.stack([x[0] for x in m.snapshot.keys])
            got_v = torch.stack([x[0] for x in m.snapshot.values])
            if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
                counts[WRONG] += 1
            counts[SERVED] += m.cached_tokens
        counts[LOOKUPS] += 1


class _Workers:
    """Four worker slots on one store: start, wait until ready, kill mid-operation, restart, stop."""

    def __init__(self, root: Path, redis_url: str, prefix: str) -> None:
        self.ctx = mp.get_context("spawn")
        self.args = (str(root), redis_url, prefix)
        self.stop = self.ctx.RawValue("b", 0)
        self.procs: dict = {}
        self.counts: dict = {}  # slot -> the live worker's counters
        self.every: list = []  # every worker's counters, killed ones included
        self.started: dict = {}  # slot -> when its worker was started
        self.kills = 0

    def start(self, slot: int) -> None:
        counts = self.ctx.RawArray("q", 5)
        p = self.ctx.Process(target=_worker, args=(*self.args, len(self.every) + 1, counts, self.stop))
        p.start()
        self.procs[slot], self.counts[slot] = p, counts
        self.every.append(counts)
        self.started[slot] = time.monotonic()

    def ops(self, counts=None) -> int:
        return sum(c[PUTS] + c[LOOKUPS] for c in ([counts] if counts is not None else self.every))

    def total(self, key: int) -> int:
        return sum(c[key] for c in self.every)

    def _alive(self) -> None:
        for slot, p in self.procs.items():
            assert p.exitcode is None, f"worker {slot} exited by itself with code {p.exitcode}"

    def pick(self, rng: random.Random) -> int:
        """A worker that is ready (imports done, store open), waiting for one if all are starting."""
        while not (ready := [slot for slot, c in self.counts.items() if c[READY]]):
            self._alive()
            late = [s for s, t in self.started.items() if time.monotonic() - t > START_S]
            assert not late, f"worker(s) {late} not ready {START_S:.0f} s after their start"
            time.sleep(0.05)
        return rng.choice(ready)

    def wait_ops(self, n: int, slot: int | None = None) -> None:
        """Until ``slot``'s worker (or all of them together) did ``n`` operations; fails on a stall."""
        counts = self.counts[slot] if slot is not None else None
        last, since = self.ops(counts), time.monotonic()
        while last < n:
            self._alive()
            time.sleep(0.002)
            if self.ops(counts) != last:
                last, since = self.ops(counts), time.monotonic()
            assert time.monotonic() - since < STALL_S, f"no operation finished in {STALL_S:.0f} s: stuck"

    def kill(self, slot: int, after_ops: int) -> None:
        """SIGKILL ``slot``'s (ready) worker ``after_ops`` operations in (so mid-put or mid-lookup,
        whatever it is doing), and start a fresh one in its place."""
        self.wait_ops(after_ops, slot)
        os.kill(self.procs[slot].pid, signal.SIGKILL)
        self.procs[slot].join(timeout=60)
        self.kills += 1
        self.start(slot)

    def finish(self) -> None:
        self.stop.value = 1
        for slot, p in self.procs.items():
            p.join(timeout=STALL_S)
            assert p.exitcode == 0, f"worker {slot}: exit code {p.exitcode} after the stop"

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def test_four_processes_disk_and_redis_under_kill_9(tmp_path, redis_url):
    n_ops = int(os.environ.get("KVLAB_SOAK_OPS", "10000"))
    n_kills = int(os.environ.get("KVLAB_SOAK_KILLS", "16"))
    prefix = f"kvlabsoak-{os.getpid()}"
    from kvlab.store import open_store

    open_store(tmp_path / "store")  # create the disk store once
    workers = _Workers(tmp_path / "store", redis_url, prefix)
    try:
        for slot in range(4):
            workers.start(slot)
        rng = random.Random(0)
        while workers.kills < n_kills:
            workers.kill(workers.pick(rng), after_ops=rng.randint(5, 60))
        workers.wait_ops(n_ops)
        workers.finish()
        totals = {k: workers.total(i) for k, i in (("puts", PUTS), ("lookups", LOOKUPS), ("served", SERVED))}
        print(f"soak: {workers.ops()} operations, {workers.kills} kill -9s, {totals}")
        assert workers.total(WRONG) == 0, workers.total(WRONG)
        assert totals["lookups"] > n_ops // 4 and totals["puts"] > n_ops // 10, totals
        assert totals["served"] > 0, totals
        final = open_store(tmp_path / "store", redis_url=redis_url, block_tokens=BLOCK)
        final.tiers[2].prefix = prefix
        report = final.verify()
        assert report["disk"]["corrupt"] == [] and report["redis"]["corrupt"] == [], report
        for seq in SEQUENCES:  # and what is stored now is exactly right
            m = final.lookup(seq, final.namespace(snapshot(seq[:BLOCK])))
            k, _ = expected(seq[: m.cached_tokens])
            assert m.snapshot is None or torch.equal(torch.stack([x[0] for x in m.snapshot.keys]), k)
    finally:
        workers.close()
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
