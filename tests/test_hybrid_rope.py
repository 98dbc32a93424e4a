"""Hybrid RoPE: Gemma-3 keeps one RoPE per layer type (local base 10,000, global 1,000,000), SmolLM3
leaves every fourth layer without RoPE. kvlab reads both from the model's own rotary module and config,
rotates each layer with its own RoPE, and refuses to rotate a layer with a guessed one.

Every exactness test here also shows that the old single-RoPE reading fails it (so it cannot pass by
accident): a cache rolled with one base for every layer is wrong by tenths of a logit."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.cache import _fuzz as F
from kvlab.cache.io import load_snapshot, save_snapshot
from kvlab.errors import BadInputError, SnapshotFileError
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.metrics.spectral import predict_raw_cosine, rope_pair_energy
from kvlab.model.facts import load_config_file
from kvlab.model.random import tiny_random_model
from kvlab.rope import LayerRopes, remove_rope, rope_from_json, shift_keys
from kvlab.rope.fast import rotate_by
from kvlab.rope.spec import rope_spec_from_config, rope_spec_from_model
from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.runner import run_experiment
from tests.conftest import CONFIG_DIR
from tests.test_rolling_cache import reference_logits, rolling_logits

GEMMA3 = CONFIG_DIR / "gemma-3-tiny-hybrid-rope.json"  # Gemma3TextConfig, 2 layers: one local, one global
# SmolLM3-3B's architecture (no_rope_layers: every fourth layer has no RoPE), shrunk to 4 layers here.
SMOLLM3 = CONFIG_DIR / "smollm3-3b-nope-layers.json"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gemma():
    return tiny_random_model(GEMMA3)


@pytest.fixture(scope="module")
def smollm3():
    return tiny_random_model(SMOLLM3, layers=4)


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_gemma3_reads_one_rope_per_layer_type_from_the_model_and_from_the_config(gemma):
    rope = gemma.rope
    assert isinstance(rope, LayerRopes) and gemma.rope_problem is None
    assert rope.kinds == ("sliding_attention", "full_attention")
    assert [s.theta for s in rope.layers] == [10_000.0, 1_000_000.0]
    # the frequencies are the model's own buffers, not re-derived
    rotary = gemma.model.model.rotary_emb
    for spec, kind in zip(rope.layers, rope.kinds, strict=True):
        assert spec.inv_freq == tuple(getattr(rotary, f"{kind}_inv_freq").double().tolist())
    from_config = rope_spec_from_config(load_config_file(GEMMA3))
    assert isinstance(from_config, LayerRopes) and [s.theta for s in from_config.layers] == [1e4, 1e6]
    assert rope_from_json(json.loads(json.dumps(rope.to_json()))) == rope
    assert "sliding_attention (1 layers)" in rope.summary() and "theta=1e+06" in rope.summary()


def test_smollm3_nope_layers_carry_no_rope(smollm3):
    rope = smollm3.rope
    assert isinstance(rope, LayerRopes)
    assert [s is None for s in rope.layers] == [False, False, False, True]
    assert rope.layers[0] == rope.layers[1] == rope.layers[2] and rope.layers[0].theta == 5e6
    assert "no RoPE" in rope.summary()
    assert rope_spec_from_model(smollm3.model) == rope


@pytest.mark.parametrize("which", ["gemma", "smollm3"])
def test_shift_equals_recomputation_at_the_new_position_for_every_layer(which, request):
    h = request.getfixturevalue(which)
    ids = _ids(20)
    at0, at37 = h.prefill(ids).snapshot, h.prefill(ids, start_position=37).snapshot
    moved = at0.with_positions(torch.arange(37, 57))
    for layer, (got, want) in enumerate(zip(moved.keys, at37.keys, strict=True)):
        assert float((got - want).abs().max()) < 1e-4, layer
    # One RoPE for every layer (the old reading) misplaces the keys of the other layer type.
    wrong = [shift_keys(k, 37, h.rope.layers[0]) for k in at0.keys]
    assert max(float((w - k).abs().max()) for w, k in zip(wrong, at37.keys, strict=True)) > 0.1


@pytest.mark.parametrize("which", ["gemma", "smollm3"])
@pytest.mark.parametrize("sinks,rebase", [(0, "always"), (4, "auto")])
def test_rolling_cache_equals_the_reference_over_many_rolls(which, sinks, rebase, request):
    h = request.getfixturevalue(which)
    ids = _ids(240)
    cache = RollingCache(
        h.config, h.rope, window=24, sinks=sinks, evict_chunk=5, max_position=60, rebase=rebase
    )
    got = rolling_logits(h, ids, cache, feed_size=3)
    ref = reference_logits(h, ids, window=24, sinks=sinks, chunk=5, feed_size=3)
    assert cache.rolls >= 30 and cache.rebases >= 5 and cache.next_position < 60
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) < 2e-4
    # the same cache with layer 0's RoPE on every layer is visibly wrong
    one = RollingCache(
        h.config, h.rope.layers[0], window=24, sinks=sinks, evict_chunk=5, max_position=60, rebase=rebase
    )
    bad = rolling_logits(h, ids, one, feed_size=3)
    assert max(float((a - b).abs().max()) for a, b in zip(bad, ref, strict=True)) > 0.05


def test_rolling_cache_for_a_plain_hf_model_with_hybrid_rope(gemma):
    cache = rolling_cache_for(gemma.model, window=24, sinks=4, evict_chunk=5)
    assert [layer.rope.theta for layer in cache.layers] == [1e4, 1e6]


def test_rotations_refuse_a_per_layer_rope_instead_of_guessing(gemma):
    k = torch.randn(1, 1, 4, gemma.facts.head_dim)
    for rotate in (
        lambda: shift_keys(k, 3, gemma.rope),
        lambda: remove_rope(k, torch.arange(4), gemma.rope),
        lambda: rotate_by(k, 3, gemma.rope),
    ):
        with pytest.raises(BadInputError, match="for_layer"):
            rotate()


def test_snapshot_files_keep_the_per_layer_rope_and_refuse_a_forged_one(gemma, tmp_path):
    snap = gemma.prefill(_ids(12)).snapshot
    p = save_snapshot(snap, tmp_path / "g.kv.safetensors")
    got = load_snapshot(p, model=gemma)
    assert got.rope == gemma.rope and F.same_snapshot(got, snap)
    header, meta, body = F.split_file(p.read_bytes())
    meta["rope"]["per_layer"] = ["full_attention", "full_attention"]  # every layer on the global base
    header["__metadata__"] = {"kvlab": json.dumps(meta)}
    p.write_bytes(F.join_file(header, body))
    with pytest.raises(SnapshotFileError):
        load_snapshot(p, model=gemma)
    meta["rope"]["per_layer"] = ["full_attention"]  # one layer's RoPE for a two-layer cache
    del meta["rope"]["specs"]["sliding_attention"]
    header["__metadata__"] = {"kvlab": json.dumps(meta)}
    p.write_bytes(F.join_file(header, body))
    with pytest.raises(SnapshotFileError, match="covers 1 layers"):
        load_snapshot(p)


def test_rope_energy_and_prediction_use_each_layers_frequencies(smollm3):
    snap = smollm3.prefill(_ids(16)).snapshot
    keys = torch.stack([k[0] for k in snap.keys]).double()  # [L, H, T, D]
    derot = torch.stack(
        [
            k if (s := smollm3.rope.for_layer(i)) is None else remove_rope(k, snap.positions, s)
            for i, k in enumerate(keys)
        ]
    )
    energy = rope_pair_energy(derot, smollm3.rope)
    assert energy.shape[:3] == (4, keys.shape[1], 16)
    assert (energy[3, ..., -1] == 1).all()  # the NoPE layer: all energy in the band that never turns
    pred = predict_raw_cosine(energy.mean(2), smollm3.rope, [0, 5, 50])
    assert pred.shape == (4, keys.shape[1], 3) and abs(pred[3] - 1).max() < 1e-12
    assert abs(pred[:3, :, 0] - 1).max() < 1e-12 and (pred[:3, :, 1] < 1).all()


def test_inspect_reports_the_hybrid_rope(tmp_path):
    ctx = ExperimentContext(out_dir=tmp_path / "i", profile="quick", options={"config": str(GEMMA3)})
    result = run_experiment(get_experiment("inspect"), ctx)
    assert result.status == "ok", result.notes
    arch = next(t for t in result.tables if t.title == "Architecture")
    rope_row = next(r for r in arch.rows if r[0] == "RoPE")
    assert "sliding_attention (1 layers): default RoPE, theta=10000" in rope_row[1]
    assert "full_attention (1 layers): default RoPE, theta=1e+06" in rope_row[1]


def test_a_model_without_rope_runs_what_does_not_move_positions_and_refuses_the_rest():
    """GPT-2 (learned absolute positions): snapshots and full-context perplexity work; a rolling cache
    and the rolling perplexity methods refuse with one clear line."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvlab.errors import UnsupportedModelError
    from kvlab.model.handle import ModelHandle
    from kvlab.streaming import stream_nll

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    h = ModelHandle(GPT2LMHeadModel(cfg))
    assert h.rope is None and h.rope_problem is None
    assert h.prefill([1, 2, 3, 4]).snapshot.seq_len == 4
    ids = _ids(60, seed=0)
    assert stream_nll(h, ids, "full", window=16).nll.shape == (59,)
    for attempt in (
        lambda: rolling_cache_for(h, window=16),
        lambda: stream_nll(h.model, ids, "sinks2", window=16),
    ):
        with pytest.raises(UnsupportedModelError, match="needs a model with RoPE"):
            attempt()


@pytest.mark.parametrize("rebase", ["never", "always"])
def test_gemma3_sliding_layers_store_only_their_window_and_equal_the_masked_reference(gemma, rebase):
    """A 100-token rolling window on Gemma-3 (64-token local layers): global layers keep the window,
    local layers store only the 63 slots they can reach (plus a chunk awaiting a trim), and the logits
    equal one forward whose masks say exactly that (the window per eviction schedule for global
    layers, the last 64 positions for local ones)."""
    from kvlab.hf.rolling_cache import SlidingRollingLayer
    from kvlab.streaming.masked import evicted_before

    n, window, w = 300, 100, 64
    ids = _ids(n)
    cache = RollingCache(gemma.config, gemma.rope, window=window, sinks=0, evict_chunk=8, rebase=rebase)
    got = torch.cat(rolling_logits(gemma, ids, cache, feed_size=3))
    assert [type(layer) is SlidingRollingLayer for layer in cache.layers] == [True, False]
    local, glob = cache.layers
    assert local.held <= w - 1 + 8 and glob.slots >= window
    assert local._buf_k.shape[-2] <= w - 1 + 2 * 8 + 3 < glob._buf_k.shape[-2]
    d = torch.from_numpy(evicted_before(n, sinks=0, window=window, feed=3, evict_chunk=8))
    t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    full = (j <= t) & (j >= d[:, None])

    def mask(visible):
        return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]

    masks = {"full_attention": mask(full), "sliding_attention": mask(full & (j > t - w))}
    with torch.no_grad():
        ref = gemma.model(
            torch.tensor([ids]), attention_mask=masks, position_ids=torch.arange(n)[None]
        ).logits[0]
    assert float((got - ref).abs().max()) < 1e-4
    if rebase == "always":
        assert cache.rebases >= 20
