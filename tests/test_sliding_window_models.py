"""Models whose layers attend through a sliding window smaller than kvlab's probes (Mistral with 64 tokens)."""

from __future__ import annotations

from kvlab.model.facts import load_config_file
from kvlab.model.handle import ModelHandle
from kvlab.model.random import tiny_random_model
from kvlab.study.experiments import ExperimentContext, registry
from kvlab.study.runner import run_experiment
from tests.conftest import config_path


def test_inspect_runs_on_a_model_whose_sliding_window_is_smaller_than_its_sink_probe(smollm, tmp_path):
    cfg = load_config_file(config_path("mistral"))
    cfg.sliding_window = 64  # the quick profile's sink probe uses 64 tokens, the default 256
    tiny = tiny_random_model(cfg, vocab=len(smollm.tokenizer))
    handle = ModelHandle(tiny.model, smollm.tokenizer, name="tiny-mistral-window-64")
    for profile in ("quick", "default"):
        ctx = ExperimentContext(
            out_dir=tmp_path / profile, profile=profile, model_spec="x", model_handle=handle
        )
        result = run_experiment(registry()["inspect"], ctx)
        assert result.status == "ok", result.notes
        assert result.summary["sinks"]["tokens"] == 63
        assert any("sliding-window layers see 64" in n for n in result.notes)
