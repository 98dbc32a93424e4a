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
    first = smollm.prefill(smollm.encode("The capital of France is"), all_logits=False)
    gen = smollm.generate(first.snapshot, first.logits[-1], 5)
    assert "Paris" in gen.text
    assert gen.snapshot.seq_len == len(smollm.encode("The capital of France is")) + len(gen.token_ids) - 1


@pytest.mark.real_model
def test_snapshot_of_another_model_is_refused_by_the_bundled_model(smollm, tiny_model):
    other = tiny_model("smollm2").prefill([1, 2, 3]).snapshot
    with pytest.raises(IncompatibleCacheError):
        smollm.extend(other, [4])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": "big"}, "cannot build"),
        ({"num_hidden_layers": -3}, "num_hidden_layers must be an integer >= 1"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"model_type": "bert"}, "not a decoder-only"),
        ({"model_type": "t5"}, "encoder-decoder"),
    ],
)
def test_bad_configs_are_one_clear_error(tmp_path, change, message):
    """Each used to give a traceback or a wrong answer (negative bytes, 0 KV heads read as 9, BERT 'cached')."""
    import json

    from kvlab.errors import BadInputError
    from kvlab.model.facts import facts_from_config, load_config_file
    from tests.conftest import config_path

    cfg = {**json.loads(config_path("llama").read_text()), **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match=message):
        facts_from_config(load_config_file(path))


def test_config_files_that_are_not_json_objects(tmp_path):
    from kvlab.errors import BadInputError
    from kvlab.model.facts import load_config_file

    for name, data, message in [
        ("binary.json", bytes(range(256)), "not UTF-8"),
        ("list.json", b"[1, 2]", "not an object"),
        ("broken.json", b'{"model_type": ', "not a JSON config"),
    ]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BadInputError, match=message):
            load_config_file(tmp_path / name)
