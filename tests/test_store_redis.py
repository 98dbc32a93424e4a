"""The Redis tier against a real redis-server: shared between processes, corruption, unreachable server.

Uses ``$KVLAB_TEST_REDIS_URL`` when set (CI); otherwise starts ``redis-server`` on a free local port
if the binary exists, and otherwise SKIPS every test here with the reason.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
import uuid

import pytest
import torch

from kvlab.store import KVStore, MemoryTier, StoreUnavailableError, open_store, prefill_with_store

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'kvlab[redis]')")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefix(redis_url):
    p = f"kvlabtest-{uuid.uuid4().hex[:8]}"
    yield p
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{p}:*"))
    if keys:
        client.delete(*keys)


def _store(url: str, prefix: str, block_tokens: int = 8) -> KVStore:
    from kvlab.store.redis_tier import RedisTier

    return KVStore([MemoryTier(), RedisTier(url, prefix=prefix)], block_tokens=block_tokens)


@pytest.fixture
def tiny(tiny_model):
    return tiny_model("smollm2", layers=2, head_dim=16)


def _ids(n: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(11)).tolist()


def _put_in_child(url: str, prefix: str, snap) -> None:
    _store(url, prefix).put(snap)
    os._exit(0)


def test_blocks_put_by_another_process_are_found_exactly(redis_url, prefix, tiny):
    ids = _ids(30)
    snap = tiny.prefill(ids[:21]).snapshot
    child = mp.get_context("fork").Process(target=_put_in_child, args=(redis_url, prefix, snap))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    st = _store(redis_url, prefix)  # a fresh store: its memory tier is empty
    pre = prefill_with_store(tiny, st, ids, store_prompt=False)
    assert pre.cached_tokens == 21 and pre.match.tier_blocks == {"redis": 3}  # 2 full blocks + a 5-token tail
    assert torch.equal(pre.match.snapshot.keys[1], snap.keys[1])  # stored bytes come back bit-exact
    torch.testing.assert_close(pre.last_logits, tiny.prefill(ids).logits[-1], rtol=1e-5, atol=1e-5)
    assert st.tiers[0].counters.promotions_in == 3
    again = st.lookup(ids, st.namespace(tiny))
    assert again.tier_blocks == {"memory": 3}
    stats = st.stats()["tiers"]["redis"]
    assert stats["blocks"] == 3 and stats["hits"] == 3 and stats["bytes"] > snap.nbytes


def test_corrupt_redis_block_is_a_reported_miss(redis_url, prefix, tiny, caplog):
    ids = _ids(16)
    st = _store(redis_url, prefix)
    rep = st.put(tiny.prefill(ids).snapshot)
    client = redis.Redis.from_url(redis_url)
    key = f"{prefix}:b:{rep.hashes[1]}"
    data = bytearray(client.get(key))
    data[-5] ^= 0x10
    client.set(key, bytes(data))
    assert len(st.verify()["redis"]["corrupt"]) == 1
    reader = _store(redis_url, prefix)
    with caplog.at_level("WARNING", logger="kvlab.store"):
        m = reader.lookup(ids, reader.namespace(tiny))
    assert m.cached_tokens == 8 and reader.tiers[1].counters.corrupt == 1 and "corrupt" in caplog.text
    assert client.get(key) is None  # dropped, so the next put can repair it
    assert reader.gc()["redis"]["stale_index_entries_removed"] == 1


def test_unreachable_redis_is_a_clear_error():
    port = _free_port()  # nothing listens there
    started = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        open_store(f"redis://127.0.0.1:{port}/0")
    assert time.perf_counter() - started < 5
    with pytest.raises(Exception, match="redis://"):
        open_store("memory", redis_url="http://127.0.0.1:1")


def test_garbage_in_a_child_index_is_a_counted_miss_not_a_crash(redis_url, prefix, tiny):
    """A crafted or damaged child index (non-JSON, wrong types, a bad key) used to crash every lookup
    that went through that parent; now each bad entry is counted and skipped."""
    ids = _ids(20)
    st = _store(redis_url, prefix)
    rep = st.put(tiny.prefill(ids[:16]).snapshot)
    client = redis.Redis.from_url(redis_url)
    index = f"{prefix}:c:{rep.hashes[-1]}"  # the parent the 4-token tail is looked up under
    client.hset(index, "x" * 64, b"\xff\xfe not json")
    client.hset(index, "y" * 64, json.dumps({"not": "a list"}))
    client.hset(index, b"\xff" * 64, json.dumps([1, 2]))
    client.hset(index, "z" * 64, json.dumps([1, "two"]))
    reader = _store(redis_url, prefix)
    m = reader.lookup(ids, reader.namespace(tiny))  # walks the broken index for the 4-token tail
    assert m.cached_tokens == 16 and reader.tiers[1].counters.corrupt == 4
    assert torch.equal(m.snapshot.keys[0], tiny.prefill(ids[:16]).snapshot.keys[0])


def test_a_redis_db_index_out_of_range_is_a_clear_error(redis_url):
    base = redis_url.rsplit("/", 1)[0]
    with pytest.raises(StoreUnavailableError, match="DB index is out of range"):
        open_store(f"{base}/99999")
