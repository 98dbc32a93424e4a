"""Suffix rolls on snapshots: exact re-positioning, the thread's variants, references, selective recompute."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.masked import first_layers_kv
from kvlab.metrics import kl_divergence
from kvlab.ops.recompute import recompute_slots
from kvlab.ops.suffix import (
    VARIANTS,
    k_ropefixed_v_rolled,
    naive_slice,
    probe_deviation,
    recompute_first,
    recompute_most_deviant,
    reprefill_rolled,
    roll,
    rolled_ids,
)
from kvlab.policy import SinksWindow, roll_amount
from kvlab.rope.ops import shift_keys
from tests.tolerances import assert_forward_close, forward_tol

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_snap(tiny_model):
    h = tiny_model("llama")
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    return h, ids, h.prefill(ids).snapshot


def test_roll_slots_positions_and_exact_keys(tiny_snap):
    h, ids, snap = tiny_snap
    before = [k.clone() for k in snap.keys]
    r = roll(snap, drop=7, sinks=3)
    assert r.seq_len == 33
    assert r.token_list() == ids[:3] + ids[10:]
    assert r.positions.tolist() == list(range(33))
    for layer, k in enumerate(snap.keys):
        assert torch.equal(r.keys[layer][:, :, :3], k[:, :, :3])  # sinks stay where they were
        assert torch.allclose(r.keys[layer][:, :, 3:], shift_keys(k[:, :, 10:], -7, h.rope), atol=1e-6)
        assert torch.equal(r.values[layer], snap.values[layer][:, :, SinksWindow.dropping(40, 7, 3).kept(40)])
        assert torch.equal(snap.keys[layer], before[layer])  # input untouched
    assert torch.equal(roll(snap, 0, 0).keys[0], snap.keys[0])


def test_repositioning_a_contiguous_window_changes_nothing(tiny_snap):
    """Relative positions are all RoPE sees: sliced-and-kept vs re-rotated give the same next logits."""
    h, ids, snap = tiny_snap
    kept = naive_slice(h, snap, 12, 0)
    moved = roll(snap, 12, 0)
    a = h.forward([5, 6, 7], kept).logits  # queries at their original positions 40..42
    b = h.forward([5, 6, 7], moved).logits  # queries at 28..30
    assert_forward_close(b, a, h, what="logits after re-rotation")


def test_references_and_thread_variants(tiny_snap):
    h, ids, snap = tiny_snap
    ref = reprefill_rolled(h, snap, 5, 2)
    assert ref.token_list() == rolled_ids(snap, 5, 2) == ids[:2] + ids[7:]
    assert torch.allclose(ref.keys[1], h.prefill(ids[:2] + ids[7:]).snapshot.keys[1])
    kv = k_ropefixed_v_rolled(h, snap, 5, 2)
    assert torch.equal(kv.values[1], ref.values[1])
    assert torch.allclose(kv.keys[1], roll(snap, 5, 2).keys[1])
    for fn in VARIANTS.values():
        assert fn(h, snap, 5, 2).seq_len == 35


def test_recompute_everything_is_the_reprefill(tiny_snap):
    h, ids, snap = tiny_snap
    rolled = roll(snap, 9, 2)
    ref = reprefill_rolled(h, snap, 9, 2)
    full = recompute_slots(h, rolled, range(rolled.seq_len))
    assert_forward_close(full.keys, ref.keys, h, what="recomputed keys")
    first = recompute_first(h, rolled, 6, sinks=2)
    for a, b, c in zip(first.keys, ref.keys, rolled.keys, strict=True):
        assert_forward_close(a[:, :, :8], b[:, :, :8], h, what="sinks + first 6")  # exact up to rounding
        assert torch.equal(a[:, :, 8:], c[:, :, 8:])  # the rest: cached
    scattered = recompute_slots(h, rolled, [0, 1, 2, 3])  # a run from 0 equals recompute_first
    assert torch.allclose(scattered.keys[1], recompute_first(h, rolled, 2, sinks=2).keys[1], atol=1e-6)


def test_probe_keys_equal_full_prefill_layers(tiny_model, smollm):
    for h in (tiny_model("qwen2"), smollm):
        ids = list(range(3, 40))
        full = h.prefill(ids).snapshot
        hooks_before = [len(layer._forward_hooks) for layer in h.model.model.layers]
        probe = first_layers_kv(h, None, torch.tensor(ids), torch.arange(len(ids)), 2)
        assert len(probe) == 2
        assert_forward_close(probe[1][0], full.keys[1], h, tol=forward_tol(h, full.keys[1], layers=2))
        # on top of a past: the new tokens' keys equal the full prefill's at those slots
        past = full.slice(0, 20)
        later = first_layers_kv(h, past, torch.tensor(ids[20:]), torch.arange(20, len(ids)), 2)
        assert_forward_close(
            later[1][0], full.keys[1][:, :, 20:], h, tol=forward_tol(h, full.keys[1], layers=2)
        )
        # the stop hook is gone (transformers may keep hooks of its own: compare with before)
        assert [len(layer._forward_hooks) for layer in h.model.model.layers] == hooks_before
        # and the next full forward is unaffected
        assert_forward_close(h.prefill(ids).snapshot.keys[-1], full.keys[-1], h)


def test_most_deviant_skips_sinks(tiny_snap):
    h, ids, snap = tiny_snap
    rolled = roll(snap, 10, 3)
    dev = probe_deviation(h, rolled)
    assert dev.shape == (rolled.seq_len,)
    assert float(dev[:3].abs().max()) < 1e-4  # sinks saw the same context
    refreshed, chosen = recompute_most_deviant(h, rolled, 4, sinks=3)
    assert len(chosen) == 4 and min(chosen) >= 3


def test_bad_input(tiny_snap):
    h, ids, snap = tiny_snap
    with pytest.raises(BadInputError, match="leaves nothing"):
        roll(snap, 40, 0)
    with pytest.raises(BadInputError, match="leaves nothing"):
        roll(snap, 30, 10)
    with pytest.raises(BadInputError):
        roll(snap, -1, 0)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        roll(snap.replace(rope=None), 3, 0)
    dyn = snap.rope.__class__(**{**snap.rope.to_json(), "rope_type": "dynamic", "shift_exact": False})
    with pytest.raises(UnsupportedModelError, match="re-prefill"):
        roll(snap.replace(rope=dyn), 3, 0)
    assert roll_amount("25%", 300) == 75 and roll_amount(0.5, 300) == 150 and roll_amount(20, 300) == 20


@pytest.mark.real_model
def test_sinks_make_the_roll_close_to_reprefill(smollm):
    """Trained behaviour: without the sink the rolled cache drifts; with it, first-token KL drops a lot."""
    text = (
        "The lighthouse keeper climbed the stairs every evening, trimmed the wick, polished the lens and "
        "wrote the weather into a small book. Ships passed far out at sea, and the keeper counted them."
    )
    ids = smollm.encode(text)
    snap = smollm.prefill(ids[:-1]).snapshot
    kls = {}
    for sinks in (0, 4):
        ref = reprefill_rolled(smollm, snap, 20, sinks)
        rolled = roll(snap, 20, sinks)
        kls[sinks] = float(
            kl_divergence(
                smollm.forward([ids[-1]], ref).logits[-1], smollm.forward([ids[-1]], rolled).logits[-1]
            )
        )
    assert kls[4] < kls[0] / 5, kls
