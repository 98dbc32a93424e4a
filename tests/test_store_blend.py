"""Non-prefix reuse (shift + EPIC / CacheBlend corrections) and forking one context into many agents."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.ops.recompute import recompute_slots
from kvlab.store import fork
from kvlab.store.blend import (
    RecomputeAll,
    RecomputeDeviating,
    RecomputeFirst,
    RotateOnly,
    blend,
    correction_by_name,
)
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tiny(tiny_model):
    return tiny_model("smollm2", layers=2, head_dim=16)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a, b, handle):
    assert_forward_close(a.keys + a.values, b.keys + b.values, handle, what="K/V")


def test_recompute_all_equals_a_full_prefill(tiny):
    pre, doc1, doc2, q = _ids(5, 1), _ids(12, 2), _ids(9, 3), _ids(4, 4)
    chunks = [tiny.prefill(doc1).snapshot, tiny.prefill(doc2).snapshot]
    b = blend(tiny, [pre, chunks[0], chunks[1], q], RecomputeAll())
    full = tiny.prefill(pre + doc1 + doc2 + q).snapshot
    assert b.recomputed_tokens == 21 and b.chunk_tokens == 21 and b.fresh_tokens == 9
    assert torch.equal(b.snapshot.positions, torch.arange(30))
    _close(b.snapshot, full, tiny)


def test_rotation_only_is_exact_for_a_chunk_at_the_start(tiny):
    doc, q = _ids(10, 5), _ids(3, 6)
    b = blend(tiny, [tiny.prefill(doc).snapshot, q], RotateOnly())
    _close(b.snapshot, tiny.prefill(doc + q).snapshot, tiny)


def test_selective_recompute_mask_is_causal_and_replaces_stale_slots(tiny):
    # If the chunk's cache is already exact, recomputing any subset must change nothing: a recomputed
    # token that saw a later slot, or its own stale slot next to its fresh one, would differ.
    before_ids, doc = _ids(6, 7), _ids(11, 8)
    full = tiny.prefill(before_ids + doc).snapshot
    before, chunk = full.slice(0, 6), full.slice(6, 17)
    for slots in ([0], [3, 4, 9], list(range(11))):
        out = recompute_slots(tiny, chunk, torch.tensor(slots), before=before)
        _close(out, chunk, tiny)
    # and a stale chunk (computed without the context) really is changed in the chosen slots only
    stale = tiny.prefill(doc).snapshot.with_positions(torch.arange(6, 17))
    fixed = recompute_slots(tiny, stale, torch.tensor([0, 1]), before=before)
    assert not torch.allclose(fixed.values[1][:, :, :2], stale.values[1][:, :, :2])
    assert torch.equal(fixed.values[1][:, :, 2:], stale.values[1][:, :, 2:])
    assert_forward_close(fixed.values[1][:, :, 0], chunk.values[1][:, :, 0], tiny, what="recomputed V")


def test_corrections_select_what_they_say(tiny):
    before = tiny.prefill(_ids(6, 9)).snapshot
    chunk = tiny.prefill(_ids(20, 10)).snapshot.with_positions(torch.arange(6, 26))
    assert RotateOnly().select(tiny, before, chunk).numel() == 0
    assert RecomputeFirst(4).select(tiny, before, chunk).tolist() == [0, 1, 2, 3]
    sel = RecomputeDeviating(0.15).select(tiny, before, chunk)
    assert sel.numel() == 3 and torch.equal(sel, sel.sort().values)
    scores = RecomputeDeviating(0.15).scores(tiny, before, chunk)
    assert set(sel.tolist()) == set(torch.topk(scores, 3).indices.tolist())
    assert RecomputeDeviating().select(tiny, None, chunk).numel() == 0  # nothing before: already exact
    with pytest.raises(BadInputError):
        correction_by_name("magic")
    with pytest.raises(BadInputError):
        RecomputeDeviating(ratio=1.5).select(tiny, before, chunk)
    with pytest.raises(BadInputError):
        blend(tiny, [])


def test_fork_shares_the_base_and_matches_independent_runs(tiny):
    base = tiny.prefill(_ids(12, 11)).snapshot
    ptrs = [k.data_ptr() for k in base.keys]
    copy = base.clone()
    agents = [_ids(3, 20 + i) for i in range(3)]
    outs = fork(tiny, base, agents, max_new_tokens=5, stop_at_eos=False)
    assert all(
        torch.equal(x, y) for x, y in zip(base.keys + base.values, copy.keys + copy.values, strict=True)
    )
    assert [k.data_ptr() for k in base.keys] == ptrs
    for a, out in zip(agents, outs, strict=True):
        solo = tiny.prefill(base.token_list() + a, all_logits=False)
        assert out.token_ids == tiny.generate(solo.snapshot, solo.logits[-1], 5, stop_at_eos=False).token_ids
    with pytest.raises(BadInputError):
        fork(tiny, base, [])
