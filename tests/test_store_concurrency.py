"""Several processes on one disk store: no torn or mixed block is ever read; a killed write leaves it valid."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.store import DiskTier
from kvlab.store.block import Block
from kvlab.store.keys import block_hash

PARENT = "a" * 64
SHAPE = (2, 4, 2048, 16)  # ~1 MiB of keys per block: big enough for reads and writes to overlap
# real content addresses: `store verify` checks that a block's tokens hash to its name
TOKENS = [tuple(range(i, i + SHAPE[2])) for i in range(3)]
HASHES = [block_hash(PARENT, t) for t in TOKENS]


def _block(h: str, fill: float) -> Block:
    k = torch.from_numpy(np.full(SHAPE, fill, dtype=np.float32))
    v = torch.from_numpy(np.full(SHAPE, fill + 0.5, dtype=np.float32))
    return Block(
        hash=h,
        parent=PARENT,
        namespace=PARENT,
        start=0,
        token_ids=TOKENS[HASHES.index(h)] if h in HASHES else TOKENS[0],
        keys=k,
        values=v,
    )


def _writer(root: str, writer_id: int, rounds: int) -> None:
    disk = DiskTier(root, create=False)
    for r in range(rounds):
        h = HASHES[(r + writer_id) % len(HASHES)]
        disk.delete(h)  # as if evicted, then rewritten with this writer's content
        disk.put(_block(h, float(writer_id)))
    os._exit(0)


def _reader(root: str, seconds: float, result: mp.Queue) -> None:
    disk = DiskTier(root, create=False)
    reads = bad = 0
    deadline = time.time() + seconds
    while time.time() < deadline:
        for h in HASHES:
            b = disk.get(PARENT, h)
            if b is None:
                continue
            k, v = b.keys.numpy(), b.values.numpy()
            fill = k.flat[0]
            reads += 1
            if not ((k == fill).all() and (v == fill + 0.5).all()):
                bad += 1
    result.put((reads, bad, disk.counters.corrupt))
    result.close()
    result.join_thread()  # flush before the hard exit
    os._exit(0)


@pytest.mark.process
@pytest.mark.slow
def test_concurrent_writers_and_readers_never_see_a_torn_or_mixed_block(tmp_path):
    root = str(tmp_path / "store")
    disk = DiskTier(root)
    for h in HASHES:
        disk.put(_block(h, 99.0))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(root, 4.0, q)) for _ in range(2)]
    writers = [ctx.Process(target=_writer, args=(root, i, 25)) for i in range(3)]
    for p in readers + writers:
        p.start()
    for p in writers + readers:
        p.join(timeout=60)
        assert p.exitcode == 0
    results = [q.get(timeout=5) for _ in readers]
    assert sum(r[0] for r in results) > 20, results  # the readers really raced the writers
    assert all(r[1] == 0 and r[2] == 0 for r in results), results
    report = DiskTier(root, create=False).verify()
    assert report["corrupt"] == [] and report["temp_files"] == []


def _slow_writer(root: str) -> None:
    disk = DiskTier(root, create=False)

    def stall(fd: int) -> None:  # the data is written but not yet renamed into place
        time.sleep(60)

    os.fsync = stall
    disk.put(_block("f" * 64, 7.0))
    os._exit(0)


@pytest.mark.process
def test_write_killed_midway_leaves_the_store_valid(tmp_path):
    root = tmp_path / "store"
    disk = DiskTier(root)
    disk.put(_block(HASHES[0], 1.0))
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_slow_writer, args=(str(root),))
    p.start()
    deadline = time.time() + 30
    while not list((root / "blocks").glob("*/.*.tmp")) and time.time() < deadline:
        time.sleep(0.05)
    temps = list((root / "blocks").glob("*/.*.tmp"))
    assert temps, "the writer never started its write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    assert p.exitcode == -signal.SIGKILL

    fresh = DiskTier(root, create=False)
    assert {e.hash for e in fresh.entries()} == {HASHES[0]}  # the half-done block is invisible
    assert fresh.get(PARENT, "f" * 64) is None
    b = fresh.get(PARENT, HASHES[0])
    assert b is not None and float(b.keys.flatten()[0]) == 1.0
    report = fresh.verify()
    assert report["corrupt"] == [] and [Path(t).name for t in report["temp_files"]] == [temps[0].name]
    assert fresh.gc(stale_seconds=0.0)["temp_files_removed"] == 1
    assert fresh.verify()["temp_files"] == []
    fresh.put(_block("f" * 64, 7.0))  # the interrupted block can be written again
    assert float(fresh.get(PARENT, "f" * 64).keys.flatten()[0]) == 7.0
