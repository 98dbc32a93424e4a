"""The store's namespace of compressed prefixes (issue 49 item 1): bit-exact through memory, disk and Redis;
keyed by namespace, policy and ids; every tampering a counted miss; never served as an exact prefix.

Redis tests use a real redis-server (``$KVLAB_TEST_REDIS_URL`` or one started by tests/conftest.py; they
skip without one). Namespaces are built by hand, but for one test on a tiny random-weight model.
"""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
import torch
from safetensors.torch import load, save

from kvlab.errors import BadInputError
from kvlab.store import KVStore, MemoryTier, Namespace, open_store
from kvlab.store.compressed import FOLDER, META_KEY, SUFFIX, CompressedPrefix, CompressedPrefixes, encode
from kvlab.store.disk import DiskTier
from kvlab.store.keys import block_hash

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GEO = (2, 2, 4)  # layers, KV heads, head size
POLICY = "snapkv,budget=4"


def _ns(**kw) -> Namespace:
    args = {"fingerprint": "model-a", "dtype": "bfloat16", "rope": None, "block_tokens": 8, "geometry": GEO}
    return Namespace(**(args | kw))


def _ids(n: int = 16, seed: int = 0) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefix(ids: list[int], policy: str = POLICY, counts=(5, 3), dtype=torch.bfloat16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for n in counts:
        pos = torch.stack([torch.randperm(len(ids), generator=g)[:n].sort().values for _ in range(GEO[1])])
        k, v = (torch.randn(1, GEO[1], n, GEO[2], generator=g).to(dtype) for _ in range(2))
        layers.append((k, v, pos.unsqueeze(0)))
    return CompressedPrefix(tuple(ids), policy, tuple(layers))


def _same(a: CompressedPrefix, b: CompressedPrefix) -> bool:
    return (a.ids, a.policy) == (b.ids, b.policy) and all(
        x.dtype == y.dtype and torch.equal(x, y)
        for la, lb in zip(a.layers, b.layers, strict=True)
        for x, y in zip(la, lb, strict=True)
    )


def _path(store: KVStore, cp: CompressedPrefixes, ns: Namespace, ids, policy: str = POLICY):
    return store.tiers[1].root / FOLDER / f"{cp.key(ns, policy, ids)}{SUFFIX}"


def _edit_meta(data: bytes, **changes) -> bytes:
    """The record with header fields changed (the length prefix rewritten; tensor bytes untouched)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"][META_KEY]) | changes
    header["__metadata__"][META_KEY] = json.dumps(meta)
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def _tamper(kind: str, a: bytes, b: bytes) -> tuple[bytes, bytes]:
    """Record bytes of A and B after one kind of damage (both swapped for "swap")."""
    if kind == "flip":
        return a[:-3] + bytes([a[-3] ^ 0x01]) + a[-2:], b
    if kind == "policy":
        return _edit_meta(a, policy="h2o,budget=4"), b
    if kind == "swap":
        return b, a
    return a[: len(a) // 2], b  # truncate


@pytest.fixture
def disk_store(tmp_path):
    return open_store(tmp_path / "store", block_tokens=8)


@pytest.fixture
def rprefix(redis_url):
    redis = pytest.importorskip("redis")
    p = f"kvlabtest-{uuid.uuid4().hex[:8]}"
    yield p
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{p}:*"))
    if keys:
        client.delete(*keys)


def _redis_store(url: str, prefix: str, folder=None) -> KVStore:
    from kvlab.store.redis_tier import RedisTier

    tiers = [MemoryTier()] + ([DiskTier(folder)] if folder else []) + [RedisTier(url, prefix=prefix)]
    return KVStore(tiers, block_tokens=8)


# -- roundtrips ------------------------------------------------------------------------------------
def test_roundtrip_memory_is_bit_exact_and_a_copy():
    store = open_store("memory", block_tokens=8)
    cp, ns, ids = CompressedPrefixes(store), _ns(), _ids()
    prefix = _prefix(ids)
    assert cp.get(ns, POLICY, ids) is None
    cp.put(ns, prefix)
    got = cp.get(ns, POLICY, ids)
    assert got is not None and _same(got, prefix) and got.nbytes == prefix.nbytes == 2 * 2 * 2 * 8 * 4
    got.layers[0][0].zero_()  # the caller's copy; the store's is untouched
    prefix.layers[1][1].zero_()  # and so is the put's argument
    again = cp.get(ns, POLICY, ids)
    assert again is not None and not torch.equal(again.layers[0][0], got.layers[0][0])
    assert not torch.equal(again.layers[1][1], prefix.layers[1][1])
    s = cp.stats()
    assert s["hits"] == {"memory": 2, "disk": 0, "redis": 0} and s["misses"] == 1 and s["puts"] == 1
    assert s["memory_bytes"] == prefix.nbytes and s["memory_entries"] == 1 and s["rejected"] == 0


def test_memory_is_bounded_lru():
    store = open_store("memory", block_tokens=8)
    one = _prefix(_ids()).nbytes
    cp, ns = CompressedPrefixes(store, memory_bytes=2 * one), _ns()
    for seed in range(3):
        cp.put(ns, _prefix(_ids(seed=seed)))
    assert cp.get(ns, POLICY, _ids(seed=0)) is None  # the oldest went out
    assert cp.get(ns, POLICY, _ids(seed=2)) is not None
    assert cp.stats()["memory_bytes"] == 2 * one and cp.stats()["evictions"] == 1


@pytest.mark.parametrize("counts", [(7, 2), (16, 0)])  # every slot; none
def test_roundtrip_disk_in_a_fresh_process_view(disk_store, tmp_path, counts):
    ns, ids = _ns(), _ids()
    prefix = _prefix(ids, counts=counts)
    CompressedPrefixes(disk_store).put(ns, prefix)
    assert _path(disk_store, CompressedPrefixes(disk_store), ns, ids).is_file()
    assert not list((tmp_path / "store" / "blocks").glob("**/*.kvc"))  # never inside the exact layout
    fresh = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8))
    got = fresh.get(ns, POLICY, ids)
    assert got is not None and _same(got, prefix)
    assert fresh.get(ns, POLICY, ids) is not None  # promoted to memory
    assert fresh.stats()["hits"] == {"memory": 1, "disk": 1, "redis": 0}


def test_roundtrip_redis_across_instances(redis_url, rprefix, tmp_path):
    ns, ids = _ns(), _ids()
    prefix = _prefix(ids)
    CompressedPrefixes(_redis_store(redis_url, rprefix)).put(ns, prefix)
    reader_store = _redis_store(redis_url, rprefix, tmp_path / "replica")
    reader = CompressedPrefixes(reader_store)
    got = reader.get(ns, POLICY, ids)
    assert got is not None and _same(got, prefix) and reader.stats()["hits"]["redis"] == 1
    assert _path(reader_store, reader, ns, ids).is_file()  # promoted to the replica's disk
    assert reader.get(ns, POLICY, ids) is not None and reader.stats()["hits"]["memory"] == 1


def test_tiny_model_namespace_binds_model_and_salt(tiny_model, tmp_path):
    handle = tiny_model("smollm2", layers=2, head_dim=16)
    store = open_store(tmp_path / "store", block_tokens=8)
    ids = _ids(20)
    snap = handle.prefill(ids).snapshot
    keep = torch.tensor([0, 3, 4, 9, 19])
    layers = tuple(
        (k[:, :, keep], v[:, :, keep], keep.expand(1, k.shape[1], -1).clone())
        for k, v in zip(snap.keys, snap.values, strict=True)
    )
    ns = store.namespace(handle, salt="tenant-1")
    CompressedPrefixes(store).put(ns, CompressedPrefix(tuple(ids), POLICY, layers))
    fresh = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8))
    got = fresh.get(ns, POLICY, ids, device="cpu")
    assert got is not None and all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, layers, strict=True))
    assert fresh.get(store.namespace(handle, salt="tenant-2"), POLICY, ids) is None
    assert fresh.get(store.namespace(handle), POLICY, ids) is None


# -- keys --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ns, policy, ids",
    [
        (_ns(), "snapkv,budget=8", _ids()),  # another policy
        (_ns(salt="tenant-2"), POLICY, _ids()),  # another tenant
        (_ns(), POLICY, _ids()[:-1]),  # a shorter prompt
        (_ns(), POLICY, _ids()[:-1] + [7]),  # another last token
        (_ns(fingerprint="model-b"), POLICY, _ids()),  # another model
        (_ns(dtype="float16"), POLICY, _ids()),  # another dtype
    ],
    ids=["policy", "salt", "shorter", "other-ids", "model", "dtype"],
)
def test_anything_else_is_a_plain_miss(disk_store, tmp_path, ns, policy, ids):
    cp = CompressedPrefixes(disk_store)
    cp.put(_ns(), _prefix(_ids()))
    fresh = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8))
    for reader in (cp, fresh):  # neither memory nor disk has it
        assert reader.get(ns, policy, ids) is None
        assert reader.stats()["misses"] == 1 and reader.stats()["rejected"] == 0
    assert cp.key(ns, policy, ids) != cp.key(_ns(), POLICY, _ids())


# -- tampering -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flip", "policy", "swap", "truncate"])
def test_tampering_on_disk_is_a_counted_miss(disk_store, tmp_path, caplog, kind):
    ns, a_ids, b_ids = _ns(), _ids(seed=0), _ids(seed=1)
    cp = CompressedPrefixes(disk_store)
    a, b = _prefix(a_ids), _prefix(b_ids, seed=2)
    cp.put(ns, a)
    cp.put(ns, b)
    pa, pb = _path(disk_store, cp, ns, a_ids), _path(disk_store, cp, ns, b_ids)
    new_a, new_b = _tamper(kind, pa.read_bytes(), pb.read_bytes())
    pa.write_bytes(new_a)
    pb.write_bytes(new_b)
    fresh = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8))
    with caplog.at_level("WARNING", logger="kvlab.store"):
        assert fresh.get(ns, POLICY, a_ids) is None
    assert fresh.stats()["rejected"] == 1 and fresh.stats()["misses"] == 1
    assert "refused" in caplog.text and not pa.exists()  # removed, so the next put repairs it
    if kind == "swap":
        assert fresh.get(ns, POLICY, b_ids) is None and fresh.stats()["rejected"] == 2
    cp.put(ns, a)
    again = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8)).get(ns, POLICY, a_ids)
    assert again is not None and _same(again, a)


@pytest.mark.parametrize("kind", ["flip", "policy", "swap", "truncate"])
def test_tampering_in_redis_is_a_counted_miss(redis_url, rprefix, kind):
    import redis

    ns, a_ids, b_ids = _ns(), _ids(seed=0), _ids(seed=1)
    cp = CompressedPrefixes(_redis_store(redis_url, rprefix))
    a, b = _prefix(a_ids), _prefix(b_ids, seed=2)
    cp.put(ns, a)
    cp.put(ns, b)
    client = redis.Redis.from_url(redis_url)
    ka, kb = (f"{rprefix}:{FOLDER}:{cp.key(ns, POLICY, i)}" for i in (a_ids, b_ids))
    new_a, new_b = _tamper(kind, client.get(ka), client.get(kb))
    client.set(ka, new_a)
    client.set(kb, new_b)
    fresh = CompressedPrefixes(_redis_store(redis_url, rprefix))
    assert fresh.get(ns, POLICY, a_ids) is None
    assert fresh.stats()["rejected"] == 1 and client.get(ka) is None  # deleted
    cp.put(ns, a)
    again = CompressedPrefixes(_redis_store(redis_url, rprefix)).get(ns, POLICY, a_ids)
    assert again is not None and _same(again, a)


def test_another_redis_type_at_the_records_key_is_a_miss_without_back_off(redis_url, rprefix):
    import redis

    ns, ids = _ns(), _ids()
    store = _redis_store(redis_url, rprefix)
    cp = CompressedPrefixes(store)
    key = f"{rprefix}:{FOLDER}:{cp.key(ns, POLICY, ids)}"
    client = redis.Redis.from_url(redis_url)
    client.hset(key, "x", "y")
    assert cp.get(ns, POLICY, ids) is None and cp.stats()["rejected"] == 1
    assert client.exists(key) == 0 and not store.tiers[1].backing_off  # exact reads go on
    cp.put(ns, _prefix(ids))
    assert CompressedPrefixes(_redis_store(redis_url, rprefix)).get(ns, POLICY, ids) is not None


def test_a_hostile_file_at_the_records_name_is_a_miss(disk_store):
    ns, ids = _ns(), _ids()
    cp = CompressedPrefixes(disk_store)
    path = _path(disk_store, cp, ns, ids)
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/zero")
    assert cp.get(ns, POLICY, ids) is None and cp.stats()["rejected"] == 1
    cp.put(ns, _prefix(ids))  # the link was removed; the record is written
    assert CompressedPrefixes(disk_store).get(ns, POLICY, ids) is not None


# -- never exact -----------------------------------------------------------------------------------
def test_exact_lookup_never_sees_compressed_records(redis_url, rprefix, tmp_path):
    ns, ids = _ns(), _ids()
    store = _redis_store(redis_url, rprefix, tmp_path / "store")
    CompressedPrefixes(store).put(ns, _prefix(ids))
    m = store.lookup(ids, ns)
    assert m.snapshot is None and m.cached_tokens == 0
    assert store.stats()["tiers"]["disk"]["blocks"] == 0 and store.stats()["tiers"]["redis"]["blocks"] == 0


@pytest.mark.parametrize("meta_key", [META_KEY, "kvlab_block"])
def test_a_compressed_record_planted_as_an_exact_block_is_an_exact_miss(
    redis_url, rprefix, tmp_path, meta_key
):
    """Under an exact block's file name and Redis key (with its index entry), a compressed record is corrupt
    to the exact reader, whether its header entry is its own or claims to be a block's."""
    import redis

    ns, ids = _ns(), _ids()
    store = _redis_store(redis_url, rprefix, tmp_path / "store")
    cp = CompressedPrefixes(store)
    data = encode(ns, cp.key(ns, POLICY, ids), _prefix(ids))
    if meta_key != META_KEY:
        n = int.from_bytes(data[:8], "little")
        data = save(load(data), metadata={meta_key: json.loads(data[8 : 8 + n])["__metadata__"][META_KEY]})
    h = block_hash(ns.root, ids[:8])
    path = store.tiers[1].root / "blocks" / ns.root / f"{h}.kvb"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    client = redis.Redis.from_url(redis_url)
    client.set(f"{rprefix}:b:{h}", data)
    client.hset(f"{rprefix}:c:{ns.root}", h, json.dumps(ids[:8]))
    m = store.lookup(ids, ns)
    assert m.snapshot is None and m.cached_tokens == 0
    assert store.tiers[1].counters.corrupt >= 1 and store.tiers[2].counters.corrupt >= 1


# -- refusals and failing tiers --------------------------------------------------------------------
def _misfits():
    ids = _ids()
    good = _prefix(ids)
    (k0, v0, p0), rest = good.layers[0], good.layers[1:]

    def with0(*layer):
        return CompressedPrefix(good.ids, good.policy, (layer, *rest))

    return {
        "dtype": with0(k0.float(), v0.float(), p0),
        "heads": with0(k0[:, :1], v0[:, :1], p0[:, :1]),
        "head-size": with0(k0[..., :2], v0[..., :2], p0),
        "v-head-size": with0(k0, v0[..., :2], p0),
        "layers": CompressedPrefix(good.ids, good.policy, good.layers[:1]),
        "batch": with0(k0.expand(2, -1, -1, -1), v0.expand(2, -1, -1, -1), p0.expand(2, -1, -1)),
        "positions-int32": with0(k0, v0, p0.int()),
        "positions-unsorted": with0(k0, v0, p0.flip(-1)),
        "positions-repeated": with0(k0, v0, torch.zeros_like(p0)),
        "positions-past-end": with0(k0, v0, p0 + len(ids)),
        "positions-negative": with0(k0, v0, p0 - 100),
        "positions-shape": with0(k0, v0, p0[..., :-1]),
        "no-policy": CompressedPrefix(good.ids, "", good.layers),
        "not-a-triple": with0(k0, v0),
    }


@pytest.mark.parametrize("name", list(_misfits()))
def test_a_misfit_put_is_refused_and_writes_nothing(redis_url, rprefix, tmp_path, name):
    import redis

    store = _redis_store(redis_url, rprefix, tmp_path / "store")
    cp = CompressedPrefixes(store)
    with pytest.raises(BadInputError, match="does not fit"):
        cp.put(_ns(), _misfits()[name])
    assert cp.stats()["memory_entries"] == 0 and cp.stats()["puts"] == 0
    assert not (tmp_path / "store" / FOLDER).exists()
    assert not list(redis.Redis.from_url(redis_url).scan_iter(f"{rprefix}:*"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failing_tiers_cost_misses_and_counted_puts_never_errors(redis_url, rprefix, tmp_path, caplog):
    import redis

    store = _redis_store(redis_url, rprefix, tmp_path / "store")
    (tmp_path / "store" / FOLDER).write_bytes(b"a file where the folder belongs")  # the disk cannot take it
    tier = store.tiers[2]
    tier.client = redis.Redis.from_url(  # a Redis that went away
        f"redis://127.0.0.1:{_free_port()}/0", socket_timeout=0.5, socket_connect_timeout=0.5
    )
    cp, ns, ids = CompressedPrefixes(store), _ns(), _ids()
    with caplog.at_level("WARNING", logger="kvlab.store"):
        assert cp.get(ns, POLICY, ids) is None
        cp.put(ns, _prefix(ids))
    s = cp.stats()
    assert s["put_failures"] == 2 and s["misses"] == 1 and s["errors"] == 1 and "not stored" in caplog.text
    assert cp.get(ns, POLICY, ids) is not None  # memory still holds it
    assert CompressedPrefixes(store).get(ns, POLICY, ids) is None  # a fresh one: both tiers miss, no error


def test_disk_records_are_capped_least_recently_used_first(disk_store, tmp_path):
    import os

    ns = _ns()
    prefixes = [_prefix(_ids(seed=s)) for s in range(3)]
    size = len(encode(ns, "0" * 64, prefixes[0]))
    cp = CompressedPrefixes(disk_store, disk_bytes=2 * size + 200)
    paths = [_path(disk_store, cp, ns, p.ids) for p in prefixes]
    now = time.time()
    for p, path, age in zip(prefixes[:2], paths, (200, 100), strict=False):
        cp.put(ns, p)
        os.utime(path, (now - age, now - age))
    reader = CompressedPrefixes(open_store(tmp_path / "store", block_tokens=8))
    assert reader.get(ns, POLICY, prefixes[0].ids) is not None  # a read makes the oldest the newest
    cp.put(ns, prefixes[2])
    assert [p.exists() for p in paths] == [True, False, True] and cp.stats()["evictions"] == 1
