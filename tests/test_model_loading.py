"""Model loading offline, the model handle's checks, and the fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvlab import load_model
from kvlab.errors import BadInputError, IncompatibleCacheError, ModelNotFoundError, UnsupportedModelError
from kvlab.model.loading import quantization_config_4bit


def test_unknown_model_offline_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        load_model("some-org/definitely-not-cached-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(BadInputError):
        load_model("  ")


def test_unknown_dtype():
    with pytest.raises(BadInputError, match="dtype"):
        load_model("smollm2-135m", dtype="float12")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_4bit_needs_cuda():
    with pytest.raises(UnsupportedModelError, match="CUDA"):
        quantization_config_4bit()


def test_bad_tokens_and_positions(tiny_model):
    handle = tiny_model("llama")
    with pytest.raises(BadInputError):
        handle.prefill([])
    with pytest.raises(BadInputError):
        handle.prefill([1, 2, 10_000])  # outside the vocabulary
    with pytest.raises(BadInputError, match="maximum"):
        handle.prefill([1, 2, 3], start_position=handle.max_positions - 1)
    with pytest.raises(BadInputError):
        handle.encode("hello")  # no tokenizer on random models


def test_fingerprint_is_stable_and_distinguishes_models(tiny_model):
    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    a1 = tiny_model("llama")
    a2 = tiny_random_model(config_path("llama"))  # same config, same seed -> same weights
    b = tiny_random_model(config_path("llama"), seed=1)
    assert a1.fingerprint == a2.fingerprint != b.fingerprint
    assert len(a1.fingerprint) == 64


@pytest.mark.real_model
def test_bundled_model(smollm):
    f = smollm.facts
    assert (f.num_layers, f.num_attention_heads, f.num_kv_heads, f.head_dim) == (30, 9, 3, 64)
    assert f.kv_bytes_per_token("float32") == 46_080 and f.kv_bytes_per_token("bfloat16") == 23_040
    assert smollm.rope.theta == 100_000 and smollm.rope.pairing == "half"
    assert smollm.encode("Once upon a time") == smollm.encode("Once upon a time")
    assert len(smollm.encode("Once upon a time")) == 4  # no BOS on plain text
    with pytest.raises(BadInputError, match="empty"):
        smollm.encode("   ")
    too_long = [42] * (smollm.max_positions + 1)
    with pytest.raises(BadInputError, match="maximum"):
        smollm.prefill(too_long)
    gen = smollm.generate_text("The capital of France is", 5)
    assert "Paris" in gen.text
    assert gen.snapshot.seq_len == len(smollm.encode("The capital of France is")) + len(gen.token_ids) - 1


@pytest.mark.real_model
def test_snapshot_of_another_model_is_refused_by_the_bundled_model(smollm, tiny_model):
    other = tiny_model("smollm2").prefill([1, 2, 3]).snapshot
    with pytest.raises(IncompatibleCacheError):
        smollm.extend(other, [4])
