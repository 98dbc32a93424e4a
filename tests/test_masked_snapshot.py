"""Masked snapshots (an evicted cache held as a KVSnapshot) and the decode loop's growing cache.

Invariants: a forward or a generation on a masked snapshot equals one over only its valid slots; the
mask travels with every snapshot operation; whatever cannot read a mask refuses it; a generation
writes into room reserved after the past without ever touching the past's tensors.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import save_snapshot, stack_rows
from kvlab.cache.snapshot import concat
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.hf.cache import GrowingLayer, to_hf_cache
from kvlab.policy.evict import TOVA, SnapKV, evict, kept_per_head, observe
from kvlab.store import KVStore
from kvlab.store.memory import MemoryTier
from tests.layers_ref import greedy_after_layers, logits_after_layers
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def h(tiny_llama_2x64):
    return tiny_llama_2x64


@pytest.fixture(scope="module")
def ev(h):
    return evict(observe(h, IDS), SnapKV(window=4, observe=4), keep=0.5)


def test_an_eviction_is_a_masked_snapshot_of_the_source(h, ev):
    src = h.prefill(IDS, all_logits=False).snapshot
    assert ev.is_masked and ev.seq_len == 48 and ev.provenance == "edited"
    assert all(torch.equal(a, b) for a, b in zip(ev.keys, src.keys, strict=True))
    assert ev.held_slots == 2 * 2 * 24 and ev.held_nbytes * 2 == ev.nbytes
    assert ev.next_position == 48 and "masked: 50% held" in ev.describe()


def test_bad_masks_are_refused(ev):
    m = ev.valid
    with pytest.raises(BadInputError, match="validity mask"):
        ev.replace(valid=m[:1])  # one layer short
    with pytest.raises(BadInputError, match="validity mask"):
        ev.replace(valid=tuple(x.to(torch.uint8) for x in m))
    with pytest.raises(BadInputError, match="validity mask"):
        ev.replace(valid=tuple(x[:, :, :10] for x in m))


def test_the_mask_travels_with_every_operation(ev):
    assert torch.equal(ev.slice(4, 20).valid[1], ev.valid[1][:, :, 4:20])
    idx = [0, 5, 9, 47]
    assert torch.equal(ev.select(idx).valid[0], ev.valid[0][:, :, idx])
    assert torch.equal(ev.clone().valid[0], ev.valid[0]) and ev.clone().valid[0] is not ev.valid[0]
    both = concat(ev.slice(0, 10), ev.slice(10, 48))
    assert all(torch.equal(a, b) for a, b in zip(both.valid, ev.valid, strict=True))
    plain = ev.replace(valid=None)
    rows = stack_rows([plain, ev])
    assert rows.batch_size == 2 and bool(rows.valid[0][0].all())
    assert torch.equal(rows.valid[0][1], ev.valid[0][0])
    assert torch.equal(ev.to(dtype=torch.float64).valid[1], ev.valid[1])


def test_whatever_cannot_read_a_mask_refuses_it(ev, tmp_path):
    with pytest.raises(IncompatibleCacheError, match="masked"):
        save_snapshot(ev, tmp_path / "x.kv.safetensors")
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(IncompatibleCacheError, match="masked"):
        to_hf_cache(ev)
    with pytest.raises(IncompatibleCacheError, match="masked"):
        KVStore([MemoryTier()], block_tokens=4).put(ev, quantization="x")
    with pytest.raises(IncompatibleCacheError, match="masked"):
        evict(ev, SnapKV(), keep=0.5)


def test_forward_and_generation_equal_the_compacted_slots(h, ev):
    keys, values, _ = kept_per_head(ev)
    question = [7, 300, 12, 5]
    want = logits_after_layers(h, keys, values, question, 48)
    fwd = h.forward(question, past=ev)
    assert_forward_close(fwd.logits, want, h, what="masked forward")
    assert fwd.snapshot.is_masked and fwd.snapshot.seq_len == 52
    assert all(bool(m[:, :, 48:].all()) for m in fwd.snapshot.valid)  # the new tokens are held
    gen = h.generate(fwd.snapshot, fwd.logits[-1], 6, stop_at_eos=False)
    assert gen.token_ids == greedy_after_layers(h, keys, values, question, 48, 7)[:6]
    assert gen.snapshot.is_masked and gen.snapshot.seq_len == 52 + 5


def test_a_batch_of_masked_and_plain_rows_equals_each_row_alone(h, ev):
    plain = h.prefill(IDS, all_logits=False).snapshot
    other = evict(observe(h, IDS), TOVA(), keep=0.25)
    question = [9, 8, 7]
    batch = stack_rows([plain, ev, other])
    got = h.forward([question] * 3, batch).logits
    for row, past in enumerate((plain, ev, other)):
        assert_forward_close(got[row], h.forward(question, past=past).logits, h, what=f"row {row}")
    first = got[:, -1]
    rows = h.generate_rows(h.forward([question] * 3, batch, all_logits=False).snapshot, first, 5)
    for row, past in enumerate((plain, ev, other)):
        alone = h.forward(question, past=past, all_logits=False)
        assert rows[row] == h.generate(alone.snapshot, alone.logits[-1], 5, stop_at_eos=False).token_ids


def test_generate_rows_stops_each_row_at_its_stop_token(h):
    snap = h.prefill(IDS, all_logits=False).snapshot
    fwd = h.forward([[1, 2], [3, 4]], stack_rows([snap, snap]), all_logits=False)
    free = h.generate_rows(fwd.snapshot, fwd.logits[:, -1], 6)
    stop = free[0][2]
    got = h.generate_rows(fwd.snapshot, fwd.logits[:, -1], 6, stop_ids={stop})
    for want, row in zip(free, got, strict=True):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert row == want[:cut]


def test_generation_writes_into_reserved_room_and_never_into_the_past(h):
    snap = h.prefill(IDS, all_logits=False)
    before = [k.clone() for k in snap.snapshot.keys]
    a = h.generate(snap.snapshot, snap.logits[-1], 8, stop_at_eos=False)
    b = h.generate(snap.snapshot, snap.logits[-1], 8, stop_at_eos=False)  # the same past again
    assert all(torch.equal(x, y) for x, y in zip(before, snap.snapshot.keys, strict=True))
    assert a.token_ids == b.token_ids
    # the generation's snapshot equals extending the past one forward at a time
    past = snap.snapshot
    for t in a.token_ids[:-1]:
        past = h.forward([t], past=past, all_logits=False).snapshot
    for x, y in zip(a.snapshot.keys, past.keys, strict=True):
        assert_forward_close(x, y, h, what="generated cache vs step-by-step extension")
    assert torch.equal(a.snapshot.token_ids, past.token_ids) and torch.equal(
        a.snapshot.positions, past.positions
    )


def test_growing_layer_keeps_earlier_views_and_grows_past_its_room():
    layer = GrowingLayer(room=2)
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    first, _ = layer.update(k, k)
    held = first.clone()
    for step in range(5):  # two fit the room, then the buffers grow (1.5x)
        one = torch.full((1, 2, 1, 4), float(step))
        keys, values = layer.update(one, one)
        assert keys.shape[-2] == 4 + step and torch.equal(keys[:, :, -1:], one)
    assert torch.equal(first, held)  # a view handed out earlier never changes
    assert torch.equal(layer.keys[:, :, :3], k) and layer.get_seq_length() == 8
