"""Gemma-3 keeps one RoPE per layer type (local base 10,000, global 1,000,000). kvlab cannot represent
that yet; it must say so, never report "no RoPE" or re-position keys with the wrong base."""

from __future__ import annotations

import pytest

from kvlab.errors import UnsupportedModelError
from kvlab.hf.rolling_cache import rolling_cache_for
from kvlab.model.facts import load_config_file
from kvlab.model.random import tiny_random_model
from kvlab.rope.spec import rope_spec_from_config, rope_spec_from_model
from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.runner import run_experiment
from tests.conftest import CONFIG_DIR

GEMMA3 = CONFIG_DIR / "gemma-3-tiny-hybrid-rope.json"  # Gemma3TextConfig, 2 layers: one local, one global


@pytest.fixture(scope="module")
def gemma():
    return tiny_random_model(GEMMA3)


def test_per_layer_type_rope_is_refused_by_name(gemma):
    for read in (
        lambda: rope_spec_from_model(gemma.model),
        lambda: rope_spec_from_config(load_config_file(GEMMA3)),
    ):
        with pytest.raises(UnsupportedModelError, match="per layer type") as err:
            read()
        assert "base 10,000" in str(err.value) and "base 1,000,000" in str(err.value)


def test_handle_runs_what_does_not_move_positions_and_refuses_what_does(gemma):
    assert gemma.rope is None and "per layer type" in gemma.rope_problem
    assert gemma.prefill([5, 6, 7, 8]).snapshot.seq_len == 4  # no positions moved: fine
    with pytest.raises(UnsupportedModelError, match="per layer type"):
        rolling_cache_for(gemma, window=16)


def test_inspect_reports_the_hybrid_rope_instead_of_none(tmp_path):
    ctx = ExperimentContext(out_dir=tmp_path / "i", profile="quick", options={"config": str(GEMMA3)})
    result = run_experiment(get_experiment("inspect"), ctx)
    assert result.status == "ok", result.notes
    arch = next(t for t in result.tables if t.title == "Architecture")
    rope_row = next(r for r in arch.rows if r[0] == "RoPE")
    assert rope_row[1].startswith("not supported:") and "per layer type" in rope_row[1]


def test_a_model_without_rope_runs_what_does_not_move_positions_and_refuses_the_rest():
    """GPT-2 (learned absolute positions): snapshots and full-context perplexity work; a rolling cache
    and the rolling perplexity methods refuse with one clear line."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvlab.model.handle import ModelHandle
    from kvlab.streaming import stream_nll

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    h = ModelHandle(GPT2LMHeadModel(cfg))
    assert h.rope is None and h.rope_problem is None
    assert h.prefill([1, 2, 3, 4]).snapshot.seq_len == 4
    ids = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    assert stream_nll(h, ids, "full", window=16).nll.shape == (59,)
    for attempt in (
        lambda: rolling_cache_for(h, window=16),
        lambda: stream_nll(h.model, ids, "sinks2", window=16),
    ):
        with pytest.raises(UnsupportedModelError, match="needs a model with RoPE"):
            attempt()
