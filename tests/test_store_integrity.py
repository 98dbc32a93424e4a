"""The store serves only what it promises: exact prefills of their tokens by the model asking.

Each case of the integrity audit (issue 12) is here: rolled, quantized, truncated-layer and
foreign-geometry caches never reach the exact namespace; crafted chains (a block that is its own
parent, a block whose hash does not match its tokens) are refused instead of looping or serving.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.ops.transfer import drop_prefix
from kvlab.policy.quant import KIVIQuantizer
from kvlab.policy.quant.snapshot import quantize_snapshot
from kvlab.store import open_store
from kvlab.store.block import Block
from kvlab.store.errors import CorruptBlockError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = list(range(5, 5 + 150))


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def full(llama):
    return llama.prefill(IDS).snapshot


def _store(tmp_path, name="st"):
    return open_store(tmp_path / name, block_tokens=16)


def test_a_prefill_is_stored_and_served_exactly(tmp_path, llama, full):
    st = _store(tmp_path)
    st.put(full, model=llama)
    hit = st.lookup(IDS, st.namespace(llama))
    assert hit.cached_tokens == len(IDS) and hit.snapshot.is_prefill
    for a, b in zip(hit.snapshot.keys, full.keys, strict=True):
        assert torch.equal(a, b)


def test_a_rolled_cache_is_refused(tmp_path, llama, full):
    rolled = drop_prefix(full, 60, sinks=4)
    assert torch.equal(rolled.positions, torch.arange(rolled.seq_len))  # looks like a prefix by positions
    st = _store(tmp_path)
    with pytest.raises(IncompatibleCacheError, match="rolled"):
        st.put(rolled)
    assert st.lookup(rolled.token_list(), st.namespace(llama)).cached_tokens == 0


def test_a_quantized_cache_goes_only_to_its_own_namespace(tmp_path, llama, full):
    lossy = quantize_snapshot(full, KIVIQuantizer(bits=2, group_size=16)).decompress()
    st = _store(tmp_path)
    with pytest.raises(IncompatibleCacheError, match="quantized"):
        st.put(lossy)
    st.put(lossy, quantization="kivi-int2")
    assert st.lookup(IDS, st.namespace(llama)).cached_tokens == 0  # the exact namespace never sees it
    q = st.lookup(IDS, st.namespace(llama, quantization="kivi-int2"))
    assert q.cached_tokens == len(IDS) and q.snapshot.provenance == "quantized"


def test_a_truncated_layer_snapshot_never_poisons_the_model(tmp_path, llama, full):
    three = full.replace(keys=full.keys[:1], values=full.values[:1], provenance="prefill")
    st = _store(tmp_path)
    with pytest.raises(IncompatibleCacheError, match="geometry"):
        st.put(three, model=llama)
    st.put(three)  # without a model to check against, it lands under its own geometry's namespace
    assert st.lookup(IDS, st.namespace(llama)).cached_tokens == 0
    st.put(full, model=llama)  # and the real prefill is still stored and served
    assert st.lookup(IDS, st.namespace(llama)).snapshot.num_layers == full.num_layers


def test_a_foreign_geometry_or_dtype_is_refused_against_the_model(tmp_path, llama, full):
    half = full.replace(
        keys=tuple(k[:, :1] for k in full.keys),
        values=tuple(v[:, :1] for v in full.values),
        provenance="prefill",
    )
    st = _store(tmp_path)
    with pytest.raises(IncompatibleCacheError, match="geometry"):
        st.put(half, model=llama)
    as64 = full.replace(
        keys=tuple(k.double() for k in full.keys),
        values=tuple(v.double() for v in full.values),
        provenance="prefill",
    )
    with pytest.raises(IncompatibleCacheError, match="dtype"):
        st.put(as64, model=llama)


def test_a_block_that_is_its_own_parent_is_an_error_not_a_loop(tmp_path, llama, full):
    st = _store(tmp_path)
    good = st.put(full, model=llama).hashes[0]
    block = st.find_block(good)
    loop = Block(
        good, good, block.namespace, 0, block.token_ids, block.keys, block.values, block.namespace_info
    )
    for tier in st.tiers:
        tier.delete(good)
        tier.put(loop)
    with pytest.raises(CorruptBlockError, match="loops"):
        st.prefix_snapshot(good)
    assert st.malformed == 1


def test_a_block_whose_tokens_do_not_match_its_hash_is_refused(tmp_path, llama, full):
    st = _store(tmp_path)
    good = st.put(full, model=llama).hashes[0]
    block = st.find_block(good)
    forged_ids = tuple(t + 1 for t in block.token_ids)
    forged = Block(
        good, block.parent, block.namespace, 0, forged_ids, block.keys, block.values, block.namespace_info
    )
    for tier in st.tiers:
        tier.delete(good)
        tier.put(forged)
    with pytest.raises(CorruptBlockError):
        st.prefix_snapshot(good)


@pytest.mark.parametrize("spec", ["ftp://127.0.0.1/x", "http://example.org/store", "s3://bucket/x"])
def test_unknown_url_schemes_are_refused_before_anything_is_created(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match="scheme"):
        open_store(spec)
    assert list(tmp_path.iterdir()) == []


def test_verify_finds_a_poisoned_block_and_repair_removes_it(tmp_path, llama, full):
    st = _store(tmp_path)
    good = st.put(full, model=llama).hashes[1]
    block = st.find_block(good)
    # right checksum, wrong content for its name: K/V of one layer under a two-layer namespace
    poisoned = Block(
        good,
        block.parent,
        block.namespace,
        block.start,
        block.token_ids,
        block.keys[:1],
        block.values[:1],
        block.namespace_info,
    )
    disk = st.tiers[1]
    disk.delete(good)
    disk.put(poisoned)
    report = st.verify()["disk"]
    assert len(report["corrupt"]) == 1 and "geometry" in report["corrupt"][0]["reason"]
    st.verify(repair=True)
    assert st.verify()["disk"]["corrupt"] == []
    fresh = open_store(tmp_path / "st", block_tokens=16)  # a new process: memory empty, disk repaired
    hit = fresh.lookup(IDS, fresh.namespace(llama))
    assert hit.cached_tokens == 16  # served up to the removed block, never the poisoned one
    assert torch.equal(hit.snapshot.keys[0], full.keys[0][:, :, :16])
