"""The transformers cache adapter: round trips, sliding-window refusal, and that nothing else touches the API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf import (
    cache_argument,
    hf_cache_layers,
    hf_cache_length,
    sliding_windows,
    snapshot_from_hf,
    to_hf_cache,
)

# the keyword transformers takes the cache by (``cache`` from 5.24, ``past_key_values`` before)
CACHE_ARG = cache_argument(LlamaForCausalLM)

SRC = Path(__file__).resolve().parents[1] / "src" / "kvlab"


def test_roundtrip_through_dynamic_cache(tiny_model):
    handle = tiny_model("llama")
    snap = handle.prefill(list(range(3, 15))).snapshot
    cache = to_hf_cache(snap, handle.config)
    assert hf_cache_length(cache) == 12
    back = snapshot_from_hf(
        cache,
        token_ids=snap.token_ids,
        positions=snap.positions,
        rope=snap.rope,
        fingerprint=snap.fingerprint,
    )
    assert all(torch.equal(a, b) for a, b in zip(back.keys, snap.keys, strict=True))


def test_to_hf_cache_copies_by_default(tiny_model):
    handle = tiny_model("llama")
    snap = handle.prefill(list(range(3, 15))).snapshot
    cache = to_hf_cache(snap, handle.config)
    k, _ = hf_cache_layers(cache)[0]
    k.zero_()  # a careless in-place write into the transformers cache...
    assert snap.keys[0].abs().sum() > 0  # ...does not reach the snapshot


def test_raw_model_call_with_adapter_cache_matches_kvlab_extend(tiny_model):
    handle = tiny_model("qwen2")
    a, b = list(range(20, 40)), [7, 8, 9]
    snap = handle.prefill(a).snapshot
    out = handle.model(
        input_ids=torch.tensor([b]), **{CACHE_ARG: to_hf_cache(snap, handle.config)}, use_cache=True
    )
    ours = handle.extend(snap, b)
    assert torch.allclose(out.logits[0].float(), ours.logits, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_with_a_snapshot_cache(family, tiny_model):
    """transformers' generate expects the cache of prompt[:-1]: with it, the same tokens as without a
    cache; with the snapshot of the whole prompt (which generate would re-feed on top, continuing from
    the prompt twice), a clear refusal instead of a silently wrong continuation."""
    handle = tiny_model(family)
    ids = torch.randint(0, handle.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = handle.model.generate(ids, max_new_tokens=6, do_sample=False)
    cached = to_hf_cache(handle.prefill(ids[0, :-1]).snapshot, handle.config)
    assert torch.equal(
        handle.model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_ARG: cached}), plain
    )
    whole = to_hf_cache(handle.prefill(ids[0]).snapshot, handle.config)
    with pytest.raises(BadInputError, match=r"prompt\[:-1\]"):
        handle.model.generate(ids, max_new_tokens=6, do_sample=False, **{CACHE_ARG: whole})


def test_sliding_window_layers_are_detected_and_a_long_snapshot_refused_as_a_transformers_cache(tiny_model):
    """kvlab's snapshot of a model with sliding layers holds every token (tests/test_sliding_snapshots.py);
    transformers' sliding layers would drop the old ones, so handing it to transformers is refused."""
    mistral = tiny_model("mistral")
    assert sliding_windows(mistral.config) == [4096, 4096]
    mistral.config.sliding_window = 8
    try:
        snap = mistral.prefill(list(range(1, 20))).snapshot
        assert snap.seq_len == 19
        with pytest.raises(UnsupportedModelError, match="sliding-window"):
            to_hf_cache(snap, mistral.config)
    finally:
        mistral.config.sliding_window = 4096


def test_no_module_outside_kvlab_hf_touches_the_transformers_cache_api():
    pattern = re.compile(r"cache_utils|DynamicCache|\.layers\[\w+\]\.(keys|values)|past_key_values\.layers")
    offenders = []
    for path in SRC.rglob("*.py"):
        if "hf" in path.relative_to(SRC).parts[:1]:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not offenders, "transformers' cache API used outside kvlab/hf:\n" + "\n".join(offenders)
