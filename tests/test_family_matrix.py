"""Issue 14's matrix: every check on every family, tiny random-weight models of

* Llama (TinyLlama), Qwen2 (biases), Mistral with a 64-token sliding window, Phi-3 with partial rotary
  (12 of 16 dims), Llama-3.1 (llama3 frequency scaling), Gemma-3 (hybrid: local layers base 10,000
  with a 64-token window, global layers base 1,000,000) and GPT-2 (learned positions, no RoPE).

Checks: a RoPE shift equals re-computing the keys at the new position, layer by layer; a RollingCache
equals the reference over many rolls and re-bases; the projected bytes per token (inspect and
``--config``) equal the cache transformers really holds, below and past sliding windows. What moves
positions is refused on GPT-2 with one clear error. (Left-padded batches on the same families:
``test_padded_batches.py``.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.errors import UnsupportedModelError
from kvlab.hf import cache_argument
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.model.facts import facts_from_config, load_config_file
from kvlab.model.random import tiny_random_model
from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.runner import run_experiment
from tests.conftest import config_path
from tests.test_rolling_cache import reference_logits, rolling_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROPE_FAMILIES = ["llama", "qwen2", "mistral-sw64", "phi3", "llama3-scaling", "gemma3"]
FAMILIES = [*ROPE_FAMILIES, "gpt2"]
_MODELS: dict = {}


def _config(family: str):
    cfg = load_config_file(config_path("mistral" if family == "mistral-sw64" else family))
    if family == "mistral-sw64":
        cfg.sliding_window = 64
    return cfg


def model(family: str):
    if family not in _MODELS:
        _MODELS[family] = tiny_random_model(_config(family))
    return _MODELS[family]


def _ids(n: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rope_shift_equals_recomputation_at_the_new_position(family):
    h = model(family)
    ids = _ids(20)
    moved = h.prefill(ids).snapshot.with_positions(torch.arange(45, 65))
    want = h.prefill(ids, start_position=45).snapshot
    # the model rotates with fp32 angles (position 64 x fp32 epsilon ~ 4e-6 rad), kvlab in float64:
    # they agree to a few 1e-6 of the key's size; 4e-5 leaves 10x headroom for other BLAS paths
    for layer, (got, ref) in enumerate(zip(moved.keys, want.keys, strict=True)):
        scale = max(float(ref.abs().max()), 1.0)
        assert float((got - ref).abs().max()) <= 4e-5 * scale, (family, layer)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rolling_cache_equals_the_reference_over_rolls_and_rebases(family):
    h = model(family)
    ids = _ids(150)
    cache = RollingCache(h.config, h.rope, window=24, sinks=4, evict_chunk=5, max_position=60, rebase="auto")
    got = rolling_logits(h, ids, cache, feed_size=3)
    ref = reference_logits(h, ids, window=24, sinks=4, chunk=5, feed_size=3)
    assert cache.rolls >= 5 and cache.rebases >= 2
    assert max(float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)) < 2e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_projected_bytes_per_token_equal_the_measured_cache(family, tmp_path):
    h = model(family)
    facts = facts_from_config(h.config)
    for n in (10, 64, 100):
        cache = DynamicCache(config=h.config)
        with torch.no_grad():
            h.model(torch.tensor([_ids(n)]), use_cache=True, **{cache_argument(h.model): cache})
        measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert facts.kv_bytes(n, "float32") == measured, (family, n)
    # inspect --config on the full-size config reports the same formula the tiny model obeys
    full = _config(family)
    path = tmp_path / "config.json"
    full.to_json_file(path)
    ctx = ExperimentContext(out_dir=tmp_path / "i", profile="quick", options={"config": str(path)})
    result = run_experiment(get_experiment("inspect"), ctx)
    assert result.status == "ok", result.notes
    dtype = result.summary["cache_dtype"]  # the weights' dtype (bfloat16 for most configs)
    assert result.summary["bytes_per_token"] == facts_from_config(full).kv_bytes_per_token(dtype)


def test_a_model_without_rope_refuses_what_moves_positions():
    h = model("gpt2")
    assert h.rope is None
    snap = h.prefill(_ids(8)).snapshot
    for attempt in (
        lambda: snap.with_positions(torch.arange(10, 18)),
        lambda: rolling_cache_for(h, window=16),
        lambda: rolling_cache_for(h.model, window=16),
    ):
        with pytest.raises(UnsupportedModelError, match="RoPE"):
            attempt()
