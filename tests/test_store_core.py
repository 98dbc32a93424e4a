"""KV store: chained keys, exact reuse, partial blocks, tiers, eviction, corruption and bad input."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from kvlab.cache import KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.store import (
    BlockNotFoundError,
    DiskTier,
    KVStore,
    MemoryTier,
    Namespace,
    StoreError,
    StoreWriteError,
    block_hash,
    chain_hashes,
    open_store,
    prefill_with_store,
)
from kvlab.store.block import Block, decode_block, encode_block
from kvlab.store.errors import CorruptBlockError, UnsupportedBlockError
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tiny(tiny_model):
    return tiny_model("smollm2", layers=2, head_dim=16)


def _ids(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def _block(fill: float, n: int = 4, parent: str = "p" * 64, h: str = "h" * 64) -> Block:
    k = torch.full((2, 1, n, 8), fill)
    return Block(
        hash=h, parent=parent, namespace=parent, start=0, token_ids=tuple(range(n)), keys=k, values=k + 1
    )


# -- keys ------------------------------------------------------------------------------------------
@pytest.mark.process
def test_chain_hashes_are_chained_and_stable_across_processes():
    ns = Namespace(fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=4)
    ids = list(range(10))
    hashes = chain_hashes(ids, ns)
    assert len(hashes) == 2  # only full blocks
    # Changing a token in block 0 changes every later hash (chaining).
    other = chain_hashes([99] + ids[1:], ns)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    code = (
        "from kvlab.store import Namespace, chain_hashes;"
        "ns = Namespace(fingerprint='f' * 64, dtype='float32', rope=None, block_tokens=4);"
        "print(','.join(chain_hashes(list(range(10)), ns)))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().split(",") == hashes


def test_namespace_separates_model_dtype_rope_block_size_and_salt(tiny):
    base = Namespace.for_model(tiny)
    variants = [
        Namespace.for_model(tiny, dtype="bfloat16"),
        Namespace.for_model(tiny, salt="tenant-a"),
        Namespace.for_model(tiny, quantization="int8"),
        Namespace.for_model(tiny, block_tokens=32),
        Namespace(fingerprint="0" * 64, dtype=base.dtype, rope=base.rope),
        Namespace(fingerprint=base.fingerprint, dtype=base.dtype, rope=None),
    ]
    roots = {base.root} | {v.root for v in variants}
    assert len(roots) == len(variants) + 1


def test_block_codec_roundtrip_and_checksum():
    b = _block(1.5)
    data = encode_block(b)
    back = decode_block(data, expect_hash=b.hash)
    assert (
        torch.equal(back.keys, b.keys)
        and torch.equal(back.values, b.values)
        and back.token_ids == b.token_ids
    )
    flipped = bytearray(data)
    flipped[-3] ^= 0x01
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(flipped))
    with pytest.raises(CorruptBlockError):
        decode_block(data, expect_hash="x" * 64)
    with pytest.raises(CorruptBlockError):
        decode_block(data[: len(data) // 2])


def _reencode_with_meta(data: bytes, **changes) -> bytes:
    """The block's bytes with fields of its kvlab metadata replaced (tensors unchanged)."""
    from safetensors.torch import load, save

    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["kvlab_block"])
    meta.update(changes)
    return save(load(data), metadata={"kvlab_block": json.dumps(meta)})


def test_blocks_are_written_with_an_xxh3_checksum():
    data = encode_block(_block(1.5))
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["kvlab_block"])
    assert meta["version"] == 2 and meta["checksum"].startswith("xxh3-64:")
    assert len(meta["checksum"]) == len("xxh3-64:") + 16


@pytest.mark.parametrize("where", ["first tensor byte", "middle", "last byte", "token id in header"])
def test_flipped_byte_in_a_block_file_is_caught_by_the_xxh3_checksum(tmp_path, where, caplog):
    b = _block(0.25, n=8)
    disk = DiskTier(tmp_path / "s")
    disk.put(b)
    path = disk._path(b.parent, b.hash)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if where == "token id in header":  # still valid JSON, so only the checksum can notice
        at = data.index(b"[0, 1, 2, 3, 4") + len("[0, 1, ")
        assert data[at : at + 1] == b"2"
        data[at] = ord("3")
    else:
        at = {"first tensor byte": 8 + n, "middle": (8 + n + len(data)) // 2, "last byte": len(data) - 1}[
            where
        ]
        data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(bytes(data), expect_hash=b.hash)
    with caplog.at_level("WARNING", logger="kvlab.store"):
        assert disk.get(b.parent, b.hash) is None
    assert disk.counters.corrupt == 1 and "xxh3-64 checksum" in caplog.text
    assert not path.exists()  # quarantined


def test_corrupt_block_read_straight_into_the_snapshot_is_never_returned(tmp_path):
    """The direct read fills the output before the checksum is known; a failed block must not leak."""
    ns = Namespace(fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=4)
    ids = list(range(100, 112))
    disk = DiskTier(tmp_path / "s")
    st = KVStore([disk], block_tokens=4)
    parent, blocks = ns.root, []
    for i, h in enumerate(chain_hashes(ids, ns)):
        k = torch.randn(2, 3, 4, 8)
        blocks.append(Block(h, parent, ns.root, i * 4, tuple(ids[i * 4 : i * 4 + 4]), k, k * 2))
        disk.put(blocks[-1])
        parent = h
    m = st.lookup(ids, ns)
    assert m.cached_tokens == 12
    torch.testing.assert_close(m.snapshot.keys[1][0, :, 4:8], blocks[1].keys[1], rtol=0, atol=0)
    path = disk._path(blocks[1].parent, blocks[1].hash)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    m = st.lookup(ids, ns)
    assert m.cached_tokens == 4 and m.blocks == (blocks[0].hash,)
    assert m.snapshot.keys[0].shape[2] == 4
    torch.testing.assert_close(m.snapshot.values[0][0], blocks[0].values[0], rtol=0, atol=0)
    assert disk.counters.corrupt == 1
    # A prefix that ends inside a block uses part of it (the general path, not the direct read).
    m = st.lookup(ids[:6] + [1, 2], ns)
    assert m.cached_tokens == 4  # block 1 is gone (quarantined)
    m = st.lookup(ids[:2] + [1, 2], ns)
    assert m.cached_tokens == 2
    torch.testing.assert_close(m.snapshot.keys[1][0], blocks[0].keys[1][:, :2], rtol=0, atol=0)


def test_assembling_on_the_target_device_equals_the_host_path(tmp_path, monkeypatch):
    """A lookup for a GPU assembles the prefix there (each block copied once, disk blocks through ``get``
    with their checksum checked on the host): forced here onto the CPU, it returns the host path's
    prefix exactly, from the memory and disk tiers, with a partly used last block, and stops at a
    corrupt block as the host path does."""
    import kvlab.store.store as store_mod

    ns = Namespace(fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=4)
    ids = list(range(200, 214))
    mem, disk = MemoryTier(), DiskTier(tmp_path / "s")
    parent = ns.root
    for i, h in enumerate(chain_hashes(ids, ns)):
        k = torch.randn(2, 3, 4, 8)
        block = Block(h, parent, ns.root, i * 4, tuple(ids[i * 4 : i * 4 + 4]), k, k * 3 + 1)
        (mem if i % 2 else disk).put(block)
        parent = h
    queries = [ids, ids[:10] + [7, 7], ids[:6]]
    host = [KVStore([mem, disk], block_tokens=4, promote=False).lookup(q, ns) for q in queries]
    monkeypatch.setattr(store_mod, "_assembles_on", lambda device: torch.device("cpu"))
    dev = [KVStore([mem, disk], block_tokens=4, promote=False).lookup(q, ns) for q in queries]
    assert [m.cached_tokens for m in host] == [m.cached_tokens for m in dev] == [12, 10, 6]
    for a, b in zip(host, dev, strict=True):
        assert a.tier_blocks == b.tier_blocks
        for x, y in zip(
            a.snapshot.keys + a.snapshot.values, b.snapshot.keys + b.snapshot.values, strict=True
        ):
            assert torch.equal(x, y)
    path = disk._path(ns.root, chain_hashes(ids, ns)[0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    assert KVStore([mem, disk], block_tokens=4).lookup(ids, ns).cached_tokens == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_direct_disk_read_is_exact_for_every_dtype(tmp_path, dtype):
    ns = Namespace(fingerprint="f" * 64, dtype=str(dtype).replace("torch.", ""), rope=None, block_tokens=4)
    ids = list(range(50, 61))  # two full blocks and a 3-token leaf
    disk = DiskTier(tmp_path / "s")
    parent, keys, values = ns.root, [], []
    for start in range(0, len(ids), 4):
        chunk = ids[start : start + 4]
        h = block_hash(parent, chunk)
        keys.append(torch.randn(3, 2, len(chunk), 8).to(dtype))
        values.append(torch.randn(3, 2, len(chunk), 8).to(dtype))
        disk.put(Block(h, parent, ns.root, start, tuple(chunk), keys[-1], values[-1]))
        parent = h
    m = KVStore([disk], block_tokens=4).lookup(ids, ns)
    assert m.cached_tokens == 11 and disk.counters.hits == 3
    assert m.snapshot.keys[0].dtype == dtype
    for layer in range(3):
        assert torch.equal(m.snapshot.keys[layer][0], torch.cat([k[layer] for k in keys], dim=1))
        assert torch.equal(m.snapshot.values[layer][0], torch.cat([v[layer] for v in values], dim=1))


def test_legacy_crc32_blocks_are_still_read_and_verified(tmp_path):
    b = _block(2.0, n=8)
    legacy = encode_block(b, checksum="crc32")
    n = int.from_bytes(legacy[:8], "little")
    meta = json.loads(json.loads(legacy[8 : 8 + n])["__metadata__"]["kvlab_block"])
    assert meta["version"] == 1 and meta["checksum"].startswith("crc32:")
    back = decode_block(legacy, expect_hash=b.hash)
    assert torch.equal(back.keys, b.keys) and torch.equal(back.values, b.values)
    flipped = bytearray(legacy)
    flipped[-5] ^= 0x10
    with pytest.raises(CorruptBlockError, match="crc32 checksum"):
        decode_block(bytes(flipped))
    # A store written by an older kvlab: both read paths accept and verify its blocks.
    ns = Namespace(fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=4)
    ids = list(range(8))
    disk = DiskTier(tmp_path / "s")
    parent, blocks = ns.root, []
    for i, h in enumerate(chain_hashes(ids, ns)):
        k = torch.randn(2, 1, 4, 8)
        blocks.append(Block(h, parent, ns.root, i * 4, tuple(ids[i * 4 : i * 4 + 4]), k, k - 1))
        path = disk._path(parent, h)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_block(blocks[-1], checksum="crc32"))
        parent = h
    m = KVStore([disk], block_tokens=4).lookup(ids, ns)
    assert m.cached_tokens == 8
    torch.testing.assert_close(m.snapshot.keys[0][0, :, 4:], blocks[1].keys[0], rtol=0, atol=0)
    assert disk.get(blocks[0].parent, blocks[0].hash) is not None
    assert disk.verify()["corrupt"] == []
    path = disk._path(blocks[1].parent, blocks[1].hash)
    path.write_bytes(bytes(flipped_at(path.read_bytes(), -1)))
    assert KVStore([disk], block_tokens=4).lookup(ids, ns).cached_tokens == 4
    assert disk.counters.corrupt == 1


def flipped_at(data: bytes, at: int) -> bytearray:
    out = bytearray(data)
    out[at] ^= 0x01
    return out


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"checksum": "blake9:00ff"}, "unknown checksum format 'blake9'"),
        ({"checksum": None}, "no usable checksum"),
        ({"version": 99}, "version 99"),
    ],
    ids=["unknown checksum algorithm", "no checksum", "newer block version"],
)
def test_block_of_an_unknown_format_is_a_clean_miss(tmp_path, changes, reason, caplog):
    ns = Namespace(fingerprint="f" * 64, dtype="float32", rope=None, block_tokens=4)
    ids = list(range(8))
    disk = DiskTier(tmp_path / "s")
    st = KVStore([MemoryTier(), disk], block_tokens=4)
    parent = ns.root
    hashes = chain_hashes(ids, ns)
    for i, h in enumerate(hashes):
        k = torch.randn(2, 1, 4, 8)
        data = encode_block(Block(h, parent, ns.root, i * 4, tuple(ids[i * 4 : i * 4 + 4]), k, k + 1))
        path = disk._path(parent, h)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_reencode_with_meta(data, **changes) if i == 1 else data)
        parent = h
    with pytest.raises(UnsupportedBlockError):
        decode_block(path.read_bytes())
    assert issubclass(UnsupportedBlockError, CorruptBlockError)  # every tier treats it as a miss
    assert st.verify()["disk"]["corrupt"][0]["path"] == str(path)
    with caplog.at_level("WARNING", logger="kvlab.store"):
        m = st.lookup(ids, ns)
    assert m.cached_tokens == 4 and disk.counters.corrupt == 1
    assert reason in caplog.text and "treated as a miss" in caplog.text
    assert disk.get(parent, hashes[1]) is None  # moved aside: a plain miss from now on


# -- exact reuse -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tiers", ["memory", "disk"])
def test_reuse_is_exact_on_tiny_model(tiny, tmp_path, tiers):
    st = open_store(
        tmp_path / "s" if tiers == "disk" else "memory",
        block_tokens=8,
        memory_bytes=1 if tiers == "disk" else 2**30,
    )
    ids = _ids(45)
    st.put(tiny.prefill(ids[:37]).snapshot)
    pre = prefill_with_store(tiny, st, ids, store_prompt=False)
    assert pre.cached_tokens == 37  # 4 full blocks + the partial 5-token tail
    assert pre.match.tier_blocks == {tiers: 5}
    full = tiny.prefill(ids)
    assert_forward_close(pre.last_logits, full.logits[-1], tiny, what="logits")
    assert_forward_close(
        pre.snapshot.keys + pre.snapshot.values, full.snapshot.keys + full.snapshot.values, tiny, what="K/V"
    )
    assert torch.equal(pre.snapshot.token_ids, full.snapshot.token_ids)


@pytest.mark.real_model
def test_reuse_is_exact_on_real_model(smollm, tmp_path):
    st = open_store(tmp_path / "s", block_tokens=16)
    shared = smollm.encode("System: you are a careful assistant who answers in one sentence. " * 2)
    q1, q2 = smollm.encode(" User: what is a lighthouse?"), smollm.encode(" User: how do tides work?")
    prefill_with_store(smollm, st, shared + q1)  # stores shared + q1
    pre = prefill_with_store(smollm, st, shared + q2, store_prompt=False)
    common = len(shared) + sum(1 for _ in zip(q1, q2, strict=False)) if q1[:1] == q2[:1] else len(shared)
    assert pre.cached_tokens >= len(shared) and pre.cached_tokens <= common
    full = smollm.prefill(shared + q2, all_logits=False)
    assert_forward_close(pre.last_logits, full.logits[-1], smollm, what="logits")


def test_short_prefix_inside_first_block_still_hits(tiny):
    st = open_store("memory", block_tokens=16)
    ids = _ids(40, seed=1)
    st.put(tiny.prefill(ids).snapshot)
    m = st.lookup(ids[:5] + [7, 7, 7], st.namespace(tiny))
    assert m.cached_tokens == 5 and m.to_compute == 3
    assert m.snapshot.token_list() == ids[:5]


def test_full_prompt_hit_recomputes_last_token(tiny):
    st = open_store("memory", block_tokens=4)
    ids = _ids(12, seed=2)
    st.put(tiny.prefill(ids).snapshot)
    pre = prefill_with_store(tiny, st, ids)
    assert pre.cached_tokens == 11 and pre.match.to_compute == 1
    assert_forward_close(pre.last_logits, tiny.prefill(ids).logits[-1], tiny, what="logits")


def test_other_model_dtype_or_rope_never_returned(tiny, tiny_model, tmp_path):
    st = open_store(tmp_path / "s", block_tokens=4)
    ids = _ids(20, seed=3)
    snap = tiny.prefill(ids).snapshot
    st.put(snap)
    assert st.lookup(ids, st.namespace(tiny)).cached_tokens == 20
    other = tiny_model("smollm2", layers=2, head_dim=16, seed=1)
    assert other.fingerprint != tiny.fingerprint
    assert st.lookup(ids, st.namespace(other)).snapshot is None
    half = snap.to(torch.bfloat16)
    assert st.lookup(ids, st.namespace(half)).snapshot is None
    ns = st.namespace(tiny)
    spec = ns.rope
    shifted_rope = type(spec)(**{**spec.to_json(), "inv_freq": tuple(f * 0.5 for f in spec.inv_freq)})
    assert st.lookup(ids, Namespace(ns.fingerprint, ns.dtype, shifted_rope, block_tokens=4)).snapshot is None
    assert st.lookup(ids, st.namespace(tiny, salt="someone-else")).snapshot is None


def test_stored_blocks_are_copies_and_put_does_not_touch_input(tiny):
    st = open_store("memory", block_tokens=4)
    snap = tiny.prefill(_ids(10, seed=4)).snapshot
    before = snap.clone()
    st.put(snap)
    snap.keys[0].add_(1.0)  # a caller scribbling on its own tensors afterwards
    got = st.lookup(snap.token_list(), st.namespace(tiny)).snapshot
    torch.testing.assert_close(got.keys[0], before.keys[0])
    assert st.put(before).blocks_written == 0  # already stored


# -- tiers -----------------------------------------------------------------------------------------
def test_slru_keeps_reused_blocks_through_a_scan():
    mem = MemoryTier(max_bytes=_block(0).nbytes * 4)
    hot = [_block(i, h=f"{i:064x}") for i in range(2)]
    for b in hot:
        mem.put(b)
        assert mem.get(b.parent, b.hash) is not None  # second touch: protected
    for i in range(10, 30):  # a one-off scan of many new blocks
        mem.put(_block(i, h=f"{i:064x}"))
    assert all(mem.contains(b.parent, b.hash) for b in hot)
    assert mem.counters.evictions == 18
    assert mem.usage()[1] <= mem.max_bytes


def test_memory_eviction_demotes_to_disk_and_disk_hit_promotes(tiny, tmp_path):
    snap = tiny.prefill(_ids(16, seed=5)).snapshot
    one_block = Namespace.for_snapshot(snap, block_tokens=4)
    mem = MemoryTier(max_bytes=snap.nbytes // 2)  # holds two of four blocks
    disk = DiskTier(tmp_path / "s")
    st = KVStore([mem, disk], block_tokens=4, write_through=False)
    st.put(snap, namespace=one_block)
    assert disk.usage()[0] == 2 and mem.usage()[0] == 2
    assert disk.counters.demotions_in == 2
    m = st.lookup(snap.token_list(), one_block)
    assert m.cached_tokens == 16 and sum(m.tier_blocks.values()) == 4 and m.tier_blocks["disk"] >= 2
    assert mem.counters.promotions_in >= 2 and mem.usage()[1] <= mem.max_bytes


def test_disk_cap_evicts_least_recently_used(tmp_path):
    one = len(encode_block(_block(0)))
    disk = DiskTier(tmp_path / "s", max_bytes=one * 3, low_water=1.0)
    blocks = [_block(i, h=f"{i:064x}") for i in range(5)]
    for i, b in enumerate(blocks):
        disk.put(b)
        os.utime(disk._path(b.parent, b.hash), (1000 + i, 1000 + i))
        if i == 2:
            os.utime(disk._path(blocks[0].parent, blocks[0].hash), (2000, 2000))  # block 0 used recently
    kept = {e.hash for e in disk.entries()}
    assert kept == {blocks[0].hash, blocks[3].hash, blocks[4].hash}
    assert disk.usage()[1] <= disk.max_bytes and disk.counters.evictions == 2


def test_corrupt_block_file_is_reported_quarantined_and_a_miss(tiny, tmp_path, caplog):
    st = open_store(tmp_path / "s", block_tokens=4, memory_bytes=1)
    ids = _ids(12, seed=6)
    st.put(tiny.prefill(ids).snapshot)
    disk = st.tiers[1]
    victim = sorted(disk.entries(), key=lambda e: e.path.stat().st_size)[0]
    entries = {e.hash: e for e in disk.entries()}
    second = chain_hashes(ids, st.namespace(tiny))[1]
    path = entries[second].path
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert victim.path.exists()
    assert st.verify()["disk"]["corrupt"][0]["path"] == str(path)
    with caplog.at_level("WARNING", logger="kvlab.store"):
        m = st.lookup(ids, st.namespace(tiny))
    assert m.cached_tokens == 4  # block 0 only; the corrupt block 1 is a miss
    assert disk.counters.corrupt == 1 and "corrupt" in caplog.text
    assert not path.exists() and len(list((tmp_path / "s" / "quarantine").iterdir())) == 1


def test_full_disk_raises_a_clear_error_and_keeps_stored_blocks(tiny, tmp_path, monkeypatch):
    st = open_store(tmp_path / "s", block_tokens=4)
    ids = _ids(12, seed=7)
    st.put(tiny.prefill(ids[:8]).snapshot)

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvlab.store.disk.atomic_write_bytes", no_space)
    with pytest.raises(StoreWriteError, match="No space left"):
        st.put(tiny.prefill(ids).snapshot)
    monkeypatch.undo()
    fresh = open_store(tmp_path / "s", block_tokens=4)
    assert fresh.lookup(ids, fresh.namespace(tiny)).cached_tokens == 8
    assert fresh.verify()["disk"]["corrupt"] == []


def test_block_larger_than_the_disk_cap_is_refused_not_stored(tmp_path):
    disk = DiskTier(tmp_path / "s", max_bytes=100)
    disk.put(_block(1.0))
    assert disk.usage() == (0, 0) and disk.counters.rejected == 1


def test_wrong_store_paths_and_unknown_blocks(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        open_store(f)
    busy = tmp_path / "home"
    busy.mkdir()
    (busy / "notes.txt").write_text("precious")
    with pytest.raises(StoreError, match="not a kvlab store"):
        open_store(busy)
    assert (busy / "notes.txt").read_text() == "precious"
    with pytest.raises(StoreError, match="no kvlab store"):
        open_store(tmp_path / "missing", create=False)
    st = open_store(tmp_path / "new")
    with pytest.raises(BlockNotFoundError):
        st.find_block("ab" * 32)
    assert json.loads((tmp_path / "new" / "kvlab-store.json").read_text())["format"] == "kvlab.store"


def test_bad_snapshots_are_refused(tiny):
    st = open_store("memory", block_tokens=4)
    snap = tiny.prefill(_ids(8, seed=8)).snapshot
    with pytest.raises(BadInputError, match="prefix caches"):
        st.put(snap.with_positions(torch.arange(8) + 3))
    two = KVSnapshot(
        keys=tuple(torch.cat([k, k]) for k in snap.keys),
        values=tuple(torch.cat([v, v]) for v in snap.values),
        token_ids=torch.cat([snap.token_ids] * 2),
        positions=snap.positions,
        rope=snap.rope,
        fingerprint=snap.fingerprint,
    )
    with pytest.raises(BadInputError, match="batch"):
        st.put(two)
    with pytest.raises(IncompatibleCacheError):
        st.put(snap, namespace=Namespace("0" * 64, "float32", snap.rope, block_tokens=4))
    with pytest.raises(BadInputError):
        KVStore([MemoryTier()], block_tokens=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64])
def test_host_copy_is_clone_bit_for_bit_on_strided_slices(dtype):
    """The store's host copy (numpy, one thread) equals ``clone`` bit for bit, owns its memory, and is
    contiguous, for the strided block slices a lookup promotes, in every dtype a store holds."""
    from kvlab.store.store import host_copy

    full = (torch.randn(4, 3, 50, 8) * 100).to(dtype)
    for piece in (full[:, :, 7:23], full[:, 1:, :, 2:], full.transpose(1, 2), full[0, 0]):
        copy = host_copy(piece)
        assert copy.dtype == piece.dtype and copy.shape == piece.shape and copy.is_contiguous()
        assert torch.equal(copy.view(torch.uint8), piece.clone().view(torch.uint8))
        assert copy.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    before = full.clone()
    host_copy(full[:, :, 7:23]).fill_(0)  # writing the copy leaves the source alone
    assert torch.equal(full, before)
