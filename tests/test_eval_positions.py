"""Positions after an offline eviction (``kvlab eval ruler --positions``): the kept keys at their original
positions, re-rotated to 0..k-1 with the question at T, or re-rotated with the question at k. With nothing
evicted all three are the full cache; the re-rotation is an exact RoPE shift of the same kept slots."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.eval.positions import CONVENTIONS, check_positions, place
from kvlab.eval.run import run_trial, summarize
from kvlab.eval.specs import parse_cache_specs
from kvlab.eval.tasks import encoder, make_trial
from kvlab.model.handle import ModelHandle
from kvlab.policy.evict import kept_per_head, observe
from kvlab.rope.ops import apply_rope, remove_rope
from tests.layers_ref import logits_after_layers
from tests.test_eval_tasks import HAYSTACK, WordTokenizer
from tests.tolerances import assert_forward_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def handle(tiny_llama_2x64):
    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


@pytest.fixture(scope="module")
def trial(handle):
    return make_trial("niah_single", handle, 160, 3, HAYSTACK)


def _rows(handle, trial, specs, positions=CONVENTIONS):
    rows = run_trial(handle, trial, parse_cache_specs(specs), max_new_tokens=6, positions=positions)
    return {(r["spec"], r.get("positions")): r for r in rows}


def test_keeping_every_slot_gives_the_full_cache_under_every_convention(handle, trial):
    rows = _rows(handle, trial, ["full", "h2o,keep=1.0"])
    full = rows[("full", None)]
    for c in CONVENTIONS:
        row = rows[("h2o,keep=1.0", c)]
        assert row["output"] == full["output"] and row["kept_slots"] == full["context_tokens"]
        assert row["kld"] == 0 and row["top1"] == 1, c


def test_place_moves_nothing_when_nothing_is_evicted(handle, trial):
    """Exactly: the placed caches' logits on the question are the full cache's, bit for bit."""
    spec = parse_cache_specs(["h2o,keep=1.0"])[0]
    encode = encoder(handle)
    ctx, question = encode(trial.context), encode(trial.question)
    obs = observe(handle, ctx)
    full = obs.snapshot
    snap, _, _ = spec.policy.layout.apply(spec.policy, obs, handle)
    want = handle.forward(question, past=full).logits
    for c in CONVENTIONS:
        placed, start = place(snap, c)
        assert start == len(ctx), c
        got = handle.forward(question, past=placed, positions=torch.arange(start, start + len(question)))
        assert torch.equal(got.logits, want), c


def test_contiguous_and_cache_rerotate_the_same_kept_slots(handle, trial):
    """The placed keys are the kept keys de-rotated at their original positions and rotated at 0..k-1
    (kvlab.rope, an independent path); the question starts at T (contiguous) or k (cache), and its logits
    equal a forward over those layers at that start."""
    spec = parse_cache_specs(["snapkv,keep=0.4"])[0]
    encode = encoder(handle)
    ctx, question = encode(trial.context), encode(trial.question)
    snap, _, _ = spec.policy.layout.apply(spec.policy, observe(handle, ctx), handle)
    keys, values, slots = kept_per_head(snap)
    k = keys[0].shape[-2]
    assert 0 < k < len(ctx)
    rope = snap.require_rope("test")
    moved = []
    for i, (kk, idx) in enumerate(zip(keys, slots, strict=True)):
        spec_i = rope.for_layer(i)
        bare = remove_rope(kk, snap.positions[idx.cpu()].to(kk.device), spec_i)
        moved.append(apply_rope(bare, torch.arange(k).expand_as(idx).to(kk.device), spec_i))
    original, start_a = place(snap, "original")
    assert original is snap and start_a == len(ctx)
    for c, start in (("contiguous", len(ctx)), ("cache", k)):
        placed, got_start = place(snap, c)
        assert got_start == start and torch.equal(placed.positions, torch.arange(k)) and not placed.is_masked
        for got, want, v, vw in zip(placed.keys, moved, placed.values, values, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(v, vw)  # values never move
        logits = handle.forward(question, past=placed, positions=torch.arange(start, start + len(question)))
        ref = logits_after_layers(handle, moved, values, question, start)
        assert_forward_close(logits.logits, ref, handle, what=c)


def test_the_eval_runs_each_convention_on_the_same_kept_slots(handle, trial):
    rows = _rows(handle, trial, ["full", "snapkv:0.6", "int4"])
    assert {key for key in rows} == {
        ("full", None),
        ("int4", None),  # a codec keeps every slot: no convention applies
        *(("snapkv:0.6", c) for c in CONVENTIONS),
    }
    evicted = [rows[("snapkv:0.6", c)] for c in CONVENTIONS]
    assert len({r["kept_slots"] for r in evicted}) == 1 and len({r["kv_bytes"] for r in evicted}) == 1
    assert all(r["compared_tokens"] == rows[("full", None)]["compared_tokens"] for r in evicted)
    # a convention's row equals that convention run alone
    alone = _rows(handle, trial, ["full", "snapkv:0.6"], positions=["cache"])
    assert alone[("snapkv:0.6", "cache")]["output"] == rows[("snapkv:0.6", "cache")]["output"]
    assert alone[("snapkv:0.6", "cache")]["kld"] == pytest.approx(
        rows[("snapkv:0.6", "cache")]["kld"], rel=1e-3, abs=1e-5
    )
    summary = summarize(list(rows.values()))
    assert sorted(s.get("positions", "-") for s in summary if s["cache"] == "snapkv:0.6") == sorted(
        CONVENTIONS
    )


def test_the_default_is_original_and_bad_conventions_are_refused(handle, trial):
    default = run_trial(handle, trial, parse_cache_specs(["full", "h2o:0.5"]), max_new_tokens=3)
    assert [r.get("positions") for r in default] == [None, "original"]  # full, then the eviction
    with pytest.raises(BadInputError, match="unknown positions convention"):
        check_positions(["gaps"])
    with pytest.raises(BadInputError, match="shared budget"):
        check_positions(["contiguous"], parse_cache_specs(["h2o,keep=0.5,layers=pyramid"]))
    check_positions(["original"], parse_cache_specs(["h2o,keep=0.5,layers=pyramid"]))


def test_resume_refuses_another_convention(tmp_path):
    from kvlab.eval.resume import _compare

    stored = {"settings": {"model": "m", "positions": "cache"}}
    with pytest.raises(BadInputError, match="positions 'cache'"):
        _compare(tmp_path, stored, {"settings": {"model": "m"}}, skip=())
    _compare(tmp_path, {"settings": {"model": "m"}}, {"settings": {"model": "m"}}, skip=())


def test_the_cli_runs_a_convention_and_records_it(handle, tmp_path, monkeypatch, capsys):
    import json

    import kvlab
    from kvlab.cli import main

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: handle)
    args = ["eval", "ruler", "--cache", "full", "--cache", "h2o:0.5", "--lengths", "160", "--tasks", "vt"]
    args += ["--trials", "2", "--max-new-tokens", "3", "--device", "cpu"]
    assert main([*args, "--positions", "cache", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "| vt | 160 | h2o:0.5 @cache | 2 |" in out
    doc = json.loads((tmp_path / "c" / "ruler.json").read_text())
    assert doc["settings"]["positions"] == "cache"
    assert {r.get("positions") for r in doc["rows"]} == {None, "cache"}
    assert main([*args, "--out", str(tmp_path / "a")]) == 0  # the default: today's settings, no key
    assert "| vt | 160 | h2o:0.5 | 2 |" in capsys.readouterr().out
    assert "positions" not in json.loads((tmp_path / "a" / "ruler.json").read_text())["settings"]
