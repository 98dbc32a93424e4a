"""Cache-size facts for models with sliding-window layers equal what transformers' cache really holds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.hf import cache_argument
from kvlab.model.facts import facts_from_config, load_config_file
from kvlab.model.random import tiny_random_model
from kvlab.study.experiments.inspect import projections
from tests.conftest import CONFIG_DIR


def _tiny(name: str, window: int | None = None):
    cfg = load_config_file(CONFIG_DIR / name)
    if window is not None:
        cfg.sliding_window = window
    return tiny_random_model(cfg)


@pytest.mark.parametrize(
    "name,window",
    [
        ("mistral-7b-v0.1.json", 64),
        ("gemma-3-tiny-hybrid-rope.json", None),
        ("tinyllama-1.1b-chat-v1.0.json", None),
    ],
)
def test_projected_bytes_equal_the_measured_cache_below_and_past_the_window(name, window):
    h = _tiny(name, window)
    facts = facts_from_config(h.config)
    for n in (10, 63, 64, 65, 200):
        cache = DynamicCache(config=h.config)
        with torch.no_grad():
            h.model(torch.randint(0, 100, (1, n)), use_cache=True, **{cache_argument(h.model): cache})
        measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert facts.kv_bytes(n, "float32") == measured, (name, n)


def test_crossover_accounts_for_sliding_layers():
    mistral = facts_from_config(load_config_file(CONFIG_DIR / "mistral-7b-v0.1.json"))
    assert mistral.num_sliding_layers == mistral.num_layers and mistral.sliding_window == 4096
    # every layer slides: the cache stops at the window and never outgrows 7B weights at batch 1 in bf16
    assert mistral.kv_bytes(100_000, "bfloat16") == mistral.kv_bytes(4095, "bfloat16")
    assert mistral.crossover_tokens("bfloat16", "bfloat16", 1) is None
    proj = projections(mistral)
    assert proj["crossover_tokens"]["bfloat16/batch1"] is None
    assert max(proj["bytes"]["float32/batch1"]) == mistral.kv_bytes(4095, "float32")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.stem)
@pytest.mark.parametrize("batch", [1, 8])
def test_crossover_is_the_first_length_whose_cache_outgrows_the_weights(path, batch):
    facts = facts_from_config(load_config_file(path))
    n = facts.crossover_tokens("bfloat16", "bfloat16", batch)
    weights = facts.weights_bytes("bfloat16")
    if n is None:  # only when every layer slides and the full window still fits under the weights
        assert facts.num_sliding_layers == facts.num_layers
        assert facts.kv_bytes(10**7, "bfloat16") * batch < weights
    else:
        assert facts.kv_bytes(n, "bfloat16") * batch >= weights > facts.kv_bytes(n - 1, "bfloat16") * batch
