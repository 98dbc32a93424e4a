"""KVSnapshot: validation, pure operations, injection equivalence, and the safetensors file format."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.cache import KVSnapshot, concat, load_snapshot, read_metadata, save_snapshot
from kvlab.cache.io import atomic_write_bytes
from kvlab.errors import BadInputError, IncompatibleCacheError, SnapshotFileError
from tests.tolerances import assert_forward_close


@pytest.fixture(scope="module")
def snap(tiny_model):
    return tiny_model("qwen2").prefill(list(range(5, 25))).snapshot


def test_geometry_and_bytes(snap):
    assert snap.num_layers == 2 and snap.seq_len == 20 and snap.batch_size == 1
    assert snap.nbytes == 2 * snap.num_layers * snap.num_kv_heads * 20 * snap.head_dim * 4
    assert snap.bytes_per_token == snap.nbytes // 20
    assert snap.next_position == 20
    assert snap.positions.tolist() == list(range(20))


def test_invalid_construction_is_rejected(snap):
    with pytest.raises(BadInputError):
        snap.replace(positions=torch.arange(3))
    with pytest.raises(BadInputError):
        snap.replace(token_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(IncompatibleCacheError):
        snap.replace(keys=(snap.keys[0], snap.keys[1][:, :, :5]))


def test_operations_never_write_into_the_original(snap):
    before = [k.clone() for k in snap.keys]
    snap.with_positions(torch.arange(20) + 50)
    snap.select([0, 3, 5])
    snap.slice(2, 9).with_positions(torch.arange(7))
    concat(snap, snap)
    assert all(torch.equal(a, b) for a, b in zip(before, snap.keys, strict=True))
    assert snap.positions.tolist() == list(range(20))


def test_select_slice_and_reposition(snap):
    part = snap.select([0, 4, 7])
    assert part.positions.tolist() == [0, 4, 7] and part.seq_len == 3
    assert torch.equal(part.keys[1][:, :, 1], snap.keys[1][:, :, 4])
    moved = part.with_positions([0, 1, 2])
    back = moved.with_positions([0, 4, 7])
    assert torch.allclose(back.keys[0], part.keys[0], atol=1e-5)
    with pytest.raises(BadInputError):
        snap.select([])
    with pytest.raises(BadInputError):
        snap.select([25])
    with pytest.raises(BadInputError):
        snap.slice(5, 5)


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_injected_cache_then_b_equals_prefill_of_a_plus_b(tiny_model, family):
    handle = tiny_model(family)
    a, b = list(range(10, 30)), list(range(100, 112))
    full = handle.prefill(a + b)
    injected = handle.extend(handle.prefill(a).snapshot, b)
    assert_forward_close(injected.logits, full.logits[len(a) :], handle, what="logits after injection")
    assert injected.snapshot.positions.tolist() == list(range(len(a) + len(b)))


def test_extend_does_not_modify_the_past(tiny_model):
    handle = tiny_model("llama")
    past = handle.prefill([1, 2, 3, 4]).snapshot
    keys_before = [k.clone() for k in past.keys]
    handle.extend(past, [5, 6])
    assert past.seq_len == 4 and all(torch.equal(x, y) for x, y in zip(keys_before, past.keys, strict=True))


def test_file_roundtrip(snap, tmp_path):
    path = save_snapshot(snap, tmp_path / "a.kv.safetensors")
    back = load_snapshot(path, expect_fingerprint=snap.fingerprint)
    assert back.fingerprint == snap.fingerprint and back.rope == snap.rope
    assert torch.equal(back.positions, snap.positions) and torch.equal(back.token_ids, snap.token_ids)
    assert all(torch.equal(x, y) for x, y in zip(back.values, snap.values, strict=True))
    assert read_metadata(path)["num_layers"] == snap.num_layers


def test_corrupt_truncated_and_foreign_files_are_rejected(snap, tmp_path):
    path = save_snapshot(snap, tmp_path / "a.kv.safetensors")
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.kv.safetensors"
    data[-10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(SnapshotFileError, match="corrupt"):
        load_snapshot(flipped)
    truncated = tmp_path / "truncated.kv.safetensors"
    truncated.write_bytes(path.read_bytes()[: len(data) // 2])
    with pytest.raises(SnapshotFileError):
        load_snapshot(truncated)
    junk = tmp_path / "junk.kv.safetensors"
    junk.write_bytes(b"not a snapshot at all")
    with pytest.raises(SnapshotFileError):
        load_snapshot(junk)
    with pytest.raises(SnapshotFileError):
        load_snapshot(tmp_path / "missing.kv.safetensors")
    with pytest.raises(IncompatibleCacheError):
        load_snapshot(path, expect_fingerprint="0" * 64)


def test_interrupted_write_keeps_the_old_file(snap, tmp_path, monkeypatch):
    path = save_snapshot(snap, tmp_path / "a.kv.safetensors")
    original = path.read_bytes()

    def crash(fd):
        raise OSError("disk died")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        atomic_write_bytes(path, b"new contents")
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["a.kv.safetensors"]  # no temp file left behind


def test_snapshot_from_another_model_is_refused(tiny_model):
    a, b = tiny_model("llama"), tiny_model("qwen2")
    past = a.prefill([1, 2, 3]).snapshot
    with pytest.raises(IncompatibleCacheError):
        b.extend(past, [4])
    assert isinstance(past, KVSnapshot)


def test_provenance_says_what_is_an_exact_prefill(tiny_model, snap):
    """Only the model's own cache at positions 0..T-1 (or a prefix of it) is a prefill."""
    handle = tiny_model("qwen2")
    assert snap.is_prefill
    assert snap.slice(0, 7).is_prefill and snap.select(range(7)).is_prefill
    assert snap.slice(3, 10).provenance == "edited"
    assert snap.select([0, 1, 2, 3, 9]).provenance == "edited"
    assert snap.with_positions(torch.arange(20) + 5).provenance == "repositioned"
    assert snap.with_positions(torch.arange(20)).is_prefill  # no shift, nothing changed
    assert snap.to(dtype=torch.float64).provenance == "edited"
    assert snap.clone().is_prefill
    assert snap.replace(values=tuple(v * 1 for v in snap.values)).provenance == "edited"
    assert concat(snap.slice(0, 10), snap.slice(10, 20)).provenance == "edited"
    assert handle.extend(snap, [3, 4]).snapshot.is_prefill  # continuing a prefill at 20, 21
    assert handle.prefill([5, 6, 7], start_position=4).snapshot.provenance == "computed"
    assert handle.extend(snap.slice(3, 20), [3]).snapshot.provenance == "computed"
    with pytest.raises(BadInputError):
        snap.replace(provenance="trust me")
