"""Smoke run of the R7 experiment (attention rows and next-token logits under a roll) on the bundled model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import BadInputError
from kvlab.study.experiments import get_experiment
from kvlab.study.experiments.base import ExperimentContext
from kvlab.study.runner import run_experiment


@pytest.mark.slow
def test_attention_smoke_run(smollm, tmp_path):
    ctx = ExperimentContext(out_dir=tmp_path / "attention", profile="quick", model_handle=smollm)
    ctx.options = {"windows": 3, "window_tokens": 48, "rolls": (1, 5)}
    result = run_experiment(get_experiment("attention"), ctx)
    doc = json.loads((tmp_path / "attention" / "result.json").read_text())
    assert doc["status"] == "ok"
    for fig in result.figures:
        assert (tmp_path / "attention" / fig.filename).stat().st_size > 1000
    arrays = np.load(tmp_path / "attention" / "arrays.npz")
    L, H = smollm.facts.num_layers, smollm.facts.num_attention_heads
    assert arrays["rows_cos"].shape == (3, 2, L, H)
    assert arrays["unrelated_cos_rest"].shape == (3, L, H)
    assert arrays["logits_js"].shape == (3, 2)
    roll1 = result.summary["by_roll"]["1"]
    # The trained model's sink: the rolled run's first slot draws mass its token never drew in the original,
    # so rows agree far better once the first aligned key is left out.
    assert roll1["attention_cos_rest"]["value"] > roll1["attention_cos"]["value"] + 0.1
    assert roll1["attention_sink_b"]["value"] > 10 * roll1["attention_first_aligned_a"]["value"]
    # A roll by one token barely moves the next-token distribution; an unrelated window does.
    assert roll1["logits_js"]["value"] < result.summary["unrelated"]["logits_js"]["value"]
    assert roll1["attention_cos_rest"]["value"] > result.summary["unrelated"]["attention_cos_rest"]["value"]


def test_attention_bad_input(tmp_path):
    """Checked before the model is loaded."""
    exp = get_experiment("attention")
    with pytest.raises(BadInputError, match="do not fit"):
        exp.run(ExperimentContext(out_dir=tmp_path), windows=2, window_tokens=32, rolls=(40,))
    with pytest.raises(BadInputError, match="at least 2 windows"):
        exp.run(ExperimentContext(out_dir=tmp_path), windows=1, window_tokens=32)
