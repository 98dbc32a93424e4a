"""Soak: 4 processes share one store (disk + Redis) for a minute while a killer SIGKILLs them.

Every process puts and looks up prefixes of a few token sequences whose K/V are a known function of
the tokens (a prefix cache: slot t depends on tokens 0..t only), so any torn, mixed or misfiled block
would show up as wrong data. Bounded: ``KVLAB_SOAK_SECONDS`` (default 60) plus a few seconds.
"""

from __future__ import annotations

import json
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


def _worker(root: str, redis_url: str, prefix: str, report: str, seed: int, until: float) -> None:
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
    counts = {"puts": 0, "lookups": 0, "served_tokens": 0, "wrong": 0}
    while time.time() < until:
        ids = rng.choice(SEQUENCES)[: rng.randint(BLOCK, 64)]
        if rng.random() < 0.4:
            st.put(snapshot(ids))
            counts["puts"] += 1
        else:
            m = st.lookup(ids, ns)
            counts["lookups"] += 1
            if m.snapshot is not None:
                k, v = expected(ids[: m.cached_tokens])
                got_k = torch.stack([x[0] for x in m.snapshot.keys])
                got_v = torch.stack([x[0] for x in m.snapshot.values])
                if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
                    counts["wrong"] += 1
                counts["served_tokens"] += m.cached_tokens
        if (counts["puts"] + counts["lookups"]) % 20 == 0:
            Path(report).write_text(json.dumps(counts))
    Path(report).write_text(json.dumps(counts))


def test_four_processes_disk_and_redis_under_kill_9(tmp_path, redis_url):
    seconds = float(os.environ.get("KVLAB_SOAK_SECONDS", "60"))
    procs: dict[int, mp.Process] = {}
    prefix = f"kvlabsoak-{os.getpid()}"
    try:
        from kvlab.store import open_store

        open_store(tmp_path / "store")  # create the disk store once
        until = time.time() + seconds
        ctx = mp.get_context("spawn")
        kills = 0
        generation = 0

        def start(slot: int) -> None:
            nonlocal generation
            generation += 1
            report = tmp_path / f"report-{slot}-{generation}.json"
            p = ctx.Process(
                target=_worker,
                args=(str(tmp_path / "store"), redis_url, prefix, str(report), generation, until),
            )
            p.start()
            procs[slot] = p

        for slot in range(4):
            start(slot)
        rng = random.Random(0)
        while time.time() < until - 2:
            time.sleep(rng.uniform(1.0, 3.0))
            slot = rng.randrange(4)
            os.kill(procs[slot].pid, signal.SIGKILL)  # mid-write or mid-read, whatever it was doing
            procs[slot].join(timeout=10)
            kills += 1
            start(slot)
        for p in procs.values():
            p.join(timeout=seconds + 60)
            assert p.exitcode == 0
        totals = {"puts": 0, "lookups": 0, "served_tokens": 0, "wrong": 0}
        for f in tmp_path.glob("report-*.json"):
            try:
                doc = json.loads(f.read_text())
            except ValueError:  # a report being rewritten when its writer was killed
                continue
            for key in totals:
                totals[key] += doc[key]
        print(f"soak: {seconds:.0f} s, {kills} kill -9s, {totals}")
        assert kills >= seconds / 4
        assert totals["wrong"] == 0, totals
        assert totals["lookups"] > 50 and totals["puts"] > 20 and totals["served_tokens"] > 0, totals
        final = open_store(tmp_path / "store", redis_url=redis_url, block_tokens=BLOCK)
        final.tiers[2].prefix = prefix
        report = final.verify()
        assert report["disk"]["corrupt"] == [] and report["redis"]["corrupt"] == [], report
        for seq in SEQUENCES:  # and what is stored now is exactly right
            m = final.lookup(seq, final.namespace(snapshot(seq[:BLOCK])))
            k, _ = expected(seq[: m.cached_tokens])
            assert m.snapshot is None or torch.equal(torch.stack([x[0] for x in m.snapshot.keys]), k)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
