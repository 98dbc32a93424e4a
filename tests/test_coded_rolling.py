"""Sinks + a rolling window over a quantized history (kvlab.hf.coded_rolling): exact bookkeeping,
packed-code steps equal to the decoded reference, bounded memory, clear refusals."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig

from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.hf.rolling_cache import RollingCache, rolling_cache_for
from kvlab.model.random import tiny_random_model
from kvlab.policy.quant.methods import QUANTIZERS, Quantizer, Segment, make_quantizer
from tests.tolerances import assert_forward_close


@dataclass(frozen=True, eq=False)
class _Same:
    x: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size()

    def decode(self) -> torch.Tensor:
        return self.x.clone()


@dataclass(frozen=True)
class _Identity(Quantizer):
    """A codec that stores its input: the coded cache must then equal the full-precision one."""

    kind = "identity_for_tests"

    def encode(self, keys, values, positions, rope) -> Segment:
        return Segment(_Same(keys.clone()), _Same(values.clone()), keys.shape[-2])


QUANTIZERS.pop("identity_for_tests")  # a test codec, not one for users


@pytest.fixture(scope="module")
def tiny():
    """2 layers, 2 KV heads of 16, max position 400: a few hundred tokens roll and re-base."""
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=400,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return tiny_random_model(cfg, head_dim=16, layers=2)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_an_identity_codec_equals_the_full_precision_window(tiny):
    """Every roll, block drop, re-base (the codes' frame) and sink re-rotation matches RollingCache."""
    ids = _ids(700)
    fp = RollingCache(tiny.config, tiny.rope, window=160, sinks=4, evict_chunk=32, max_position=400)
    coded = RollingCache(
        tiny.config,
        tiny.rope,
        window=160,
        sinks=4,
        evict_chunk=32,
        max_position=400,
        codec=_Identity(window=16, group_size=16),
    )
    assert_forward_close(tiny.run(ids[:, :100], coded).logits, tiny.run(ids[:, :100], fp).logits, tiny)
    for s in range(100, 700):
        got, want = tiny.run(ids[:, s : s + 1], coded).logits, tiny.run(ids[:, s : s + 1], fp).logits
        assert_forward_close(got, want, tiny, what=f"logits at token {s}")
        if s % 97 == 0:
            for a, b in zip(coded.kept_layers(), fp.kept_layers(), strict=True):
                assert_forward_close(list(a), list(b), tiny, what=f"kept K/V at token {s}")
    assert coded.rebases == fp.rebases >= 2 and coded.rolls == fp.rolls >= 15
    assert coded.layers[0].frame > 0 and len(coded.layers[0].segments) >= 3
    assert coded.positions().tolist() == fp.positions().tolist()


@pytest.mark.parametrize(("method", "bits"), [("pertoken", 4), ("kivi", 4), ("rotation", 4), ("fp8", None)])
@torch.no_grad()
def test_packed_steps_equal_the_decoded_window(tiny, method, bits):
    """A bound cache attends over the packed codes (after a re-base, with the query turned by the codes'
    frame): each step's logits equal SDPA over what the cache held before the step, decoded, with the
    query at the cache's next position — through rolls and re-bases."""
    from tests.layers_ref import logits_after_layers

    codec = make_quantizer(method, bits, group_size=16)
    cache = rolling_cache_for(tiny, window=160, sinks=4, evict_chunk=32, codec=codec)
    ids = _ids(340, 1)
    tiny.model(input_ids=ids[:, :100], cache=cache)
    for s in range(100, 340):
        held = cache.kept_layers()
        at = cache.next_position  # with any pending re-base applied
        ref = logits_after_layers(
            tiny, tuple(k for k, _ in held), tuple(v for _, v in held), [int(ids[0, s])], at
        )
        got = tiny.model(input_ids=ids[:, s : s + 1], cache=cache).logits[0]
        assert_forward_close(got, ref, tiny, what=f"{method} step at token {s}")
    assert cache.rebases >= 1 and cache.layers[0].frame > 0 and cache.rolls >= 5
    assert cache.packed_steps == (0 if method == "fp8" else 240)  # fp8 codes are read decoded
    assert sum(cache.packed_steps_by_path.values()) == cache.packed_steps  # one path per step


@torch.no_grad()
def test_memory_stays_bounded_under_generate(tiny):
    """1,500 generated tokens through model.generate: the bytes held never grow past the full window's."""
    codec = make_quantizer("kivi", 4, group_size=16)
    cache = rolling_cache_for(tiny, window=160, sinks=4, evict_chunk=32, codec=codec)
    seen: list[int] = []

    def watch(_ids, scores):
        seen.append(cache.nbytes())
        return scores

    out = tiny.model.generate(
        _ids(64, 2),
        cache=cache,
        max_new_tokens=1500,
        min_new_tokens=1500,
        do_sample=False,
        logits_processor=[watch],
    )
    assert out.shape[-1] == 64 + 1500 and cache.tokens_seen == 64 + 1499 and cache.rebases >= 4
    layer = cache.layers[0]
    fp_bytes_per_slot = 2 * 2 * 16 * 4 * 2  # K and V, 2 heads x 16 dims, fp32, 2 layers
    # fp: sinks and their re-rotated keys, the tail, one block waiting to be encoded, the new token
    fp_slots = 4 + 4 + layer.tail_slots + layer.block + 1
    assert max(seen) <= fp_slots * fp_bytes_per_slot + 2 * (160 // layer.block) * layer.segments[0].nbytes
    assert max(seen[500:]) <= max(seen[:500])  # steady state: no growth
    # a 160-slot window keeps up to 65 of its newest slots in fp (KIVI's 32-slot tail and a block waiting
    # to be encoded); the rest is int4 codes: well under the same slots in fp32
    assert cache.nbytes() < 0.6 * cache.kept * fp_bytes_per_slot


def test_refusals_are_clear(tiny, tiny_model):
    kivi = make_quantizer("kivi", 4, group_size=16)
    with pytest.raises(BadInputError, match="needs at least the eviction chunk"):
        rolling_cache_for(tiny, window=64, sinks=4, codec=kivi)
    with pytest.raises(BadInputError, match="own sinks"):
        rolling_cache_for(tiny, window=256, codec=make_quantizer("kivi", 4, group_size=16, sinks=4))
    with pytest.raises(BadInputError, match="group size"):
        rolling_cache_for(tiny, window=256, codec=make_quantizer("kivi", 4))  # 32 does not divide 16
    gemma = tiny_model("gemma3")
    with pytest.raises(UnsupportedModelError, match="full-attention models only"):
        rolling_cache_for(gemma, window=4096, codec=make_quantizer("pertoken", 4, group_size=16))
    chunked = rolling_cache_for(tiny, window=256, evict_chunk=5, codec=kivi)
    assert chunked.evict_chunk == 32  # rounded up to whole blocks of codes


@torch.no_grad()
def test_checkpoint_restores_a_coded_window(tiny):
    """The server's per-row isolation: a failed step is undone exactly, rolls and encodes included."""
    codec = make_quantizer("pertoken", 4, group_size=16)
    cache = RollingCache(
        tiny.config, tiny.rope, window=160, sinks=4, evict_chunk=32, codec=codec, max_position=400
    )
    ids = _ids(400, 3)
    tiny.run(ids[:, :190], cache)
    for s in range(190, 260):
        restore = cache.checkpoint()
        want = tiny.run(ids[:, s : s + 1], cache).logits
        restore()
        assert torch.equal(tiny.run(ids[:, s : s + 1], cache).logits, want)
    assert cache.rolls >= 2


@torch.no_grad()
def test_a_prompt_in_pieces_equals_one_forward(tiny):
    """With the roll (and so the codes) held between pieces, each piece sees the earlier ones in full
    precision: the cache and the next logits equal one forward over the whole prompt."""
    codec = make_quantizer("kivi", 4, group_size=16)
    ids = _ids(300, 4)
    whole = RollingCache(
        tiny.config, tiny.rope, window=160, sinks=4, evict_chunk=32, codec=codec, max_position=400
    )
    pieces = RollingCache(
        tiny.config, tiny.rope, window=160, sinks=4, evict_chunk=32, codec=codec, max_position=400
    )
    want = tiny.run(ids[:, :150], whole).logits[0, -1]
    for a in range(0, 150, 7):
        got = tiny.run(ids[:, a : min(a + 7, 150)], pieces).logits[0, -1]
        if a + 7 < 150:
            pieces.hold_roll()
    assert_forward_close(got, want, tiny, what="last logits after the pieces")
    for a_kv, b_kv in zip(pieces.kept_layers(), whole.kept_layers(), strict=True):
        assert_forward_close(list(a_kv), list(b_kv), tiny, what="kept K/V")
    nxt = ids[:, 150:151]
    assert_forward_close(tiny.run(nxt, pieces).logits, tiny.run(nxt, whole).logits, tiny, what="next step")
    assert len(pieces.layers[0].segments) == len(whole.layers[0].segments) > 0
