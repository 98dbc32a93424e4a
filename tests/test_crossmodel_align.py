"""Cross-tokenizer span alignment and cross-geometry ridge maps (C2C-lite), with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError, IncompatibleCacheError
from kvlab.model.align import align_by_spans, aligned_snapshots
from kvlab.model.handle import ModelHandle
from kvlab.ops.crossmodel import (
    apply_cache_map,
    cache_map_grid,
    explained_variance,
    fit_cross_model_map,
    ridge_fit,
    transplant,
)
from kvlab.rope.ops import apply_rope
from kvlab.rope.spec import RopeSpec

TEXT = (
    "Hello, my name is Lyra and I live in Seattle. The cache holds keys and values; "
    "each key was rotated to its position 42 before it was stored."
)
TEXTS = [
    TEXT,
    "Python lists are mutable sequences, typically used to store collections of homogeneous items.",
    "A tuple is an immutable sequence; a dict maps hashable keys to arbitrary values, in insertion order.",
    "The with statement wraps the execution of a block with methods defined by a context manager.",
    "Exceptions raised in the try clause are handled by the first matching except clause, if any.",
]
ODD = "Quantization isn't free: 3.14159, naïve café 🎉 done."


def _fast_tokenizer(kind: str, texts: list[str]):
    """A tiny fast tokenizer: 'word' (words and punctuation, adds <bos> like Gemma) or 'char' (one per char)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if kind == "word":
        pre = pre_tokenizers.Whitespace()
    else:
        pre = pre_tokenizers.Split(Regex("."), behavior="isolated")
    pieces = sorted({p for t in texts for p, _ in pre.pre_tokenize_str(t)})
    vocab = {"<unk>": 0, "<bos>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre
    if kind == "word":
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<bos>")


@pytest.fixture(scope="module")
def two_tokenizers():
    return _fast_tokenizer("word", [*TEXTS, ODD]), _fast_tokenizer("char", [*TEXTS, ODD])


def test_span_alignment_pairs_tokens_ending_at_the_same_character(two_tokenizers):
    word, char = two_tokenizers
    al = align_by_spans(char, word, TEXT)
    w_ids, c_ids = word(TEXT)["input_ids"], char(TEXT)["input_ids"]
    assert al.src_ids == tuple(c_ids) and al.dst_ids == tuple(w_ids)
    assert w_ids[0] == 1 and 0 not in al.dst_slots  # <bos> has an empty span: never paired
    # every character-level token ends somewhere, so every word-level token is paired exactly once
    assert len(al) == len(w_ids) - 1 and al.coverage[1] == pytest.approx((len(w_ids) - 1) / len(w_ids))
    offsets = word(TEXT, return_offsets_mapping=True)["offset_mapping"]
    for c_slot, w_slot, end in zip(al.src_slots, al.dst_slots, al.char_ends, strict=True):
        assert offsets[w_slot][1] == end == c_slot + 1  # char slot t covers character t
    # skip_first drops the pairs inside the first text token(s) of either side
    skipped = align_by_spans(char, word, TEXT, skip_first=1)
    assert skipped.char_ends[0] > al.char_ends[0] and len(skipped) == len(al) - 1
    with pytest.raises(BadInputError, match="tokenizers"):
        align_by_spans(None, word, TEXT)


@pytest.mark.real_model
def test_span_alignment_on_two_real_tokenizers(smollm, two_tokenizers):
    word, _ = two_tokenizers
    text = ODD
    al = align_by_spans(smollm.tokenizer, word, text)
    assert al.src_ids == tuple(smollm.encode(text))
    s_off = smollm.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    w_off = word(text, return_offsets_mapping=True)["offset_mapping"]
    for a, b, e in zip(al.src_slots, al.dst_slots, al.char_ends, strict=True):
        assert s_off[a][1] == w_off[b][1] == e
    # the emoji is several byte-level tokens sharing one end offset: only the last one is paired
    emoji_end = text.index("🎉") + 1
    ending = [i for i, (_, b) in enumerate(s_off) if b == emoji_end]
    assert len(ending) > 1 and emoji_end in al.char_ends
    assert al.src_slots[al.char_ends.index(emoji_end)] == ending[-1]
    assert text[: al.char_ends[-1]] == text  # the final "." is a shared boundary


def test_ridge_explained_variance_matches_the_known_signal_to_noise():
    # y = x W + noise: the held-out R^2 of the fitted map must be var(xW) / (var(xW) + var(noise)).
    gen = torch.Generator().manual_seed(0)
    n, din, dout, sigma = 4000, 12, 6, 0.5
    w_true = torch.randn(din, dout, generator=gen, dtype=torch.float64) / math.sqrt(din)
    x = torch.randn(2 * n, din, generator=gen, dtype=torch.float64)
    y = x @ w_true + 3.0 + sigma * torch.randn(2 * n, dout, generator=gen, dtype=torch.float64)
    w, b = ridge_fit(x[:n], y[:n], alpha=1e-6)
    assert torch.allclose(w, w_true, atol=0.03) and torch.allclose(
        b, torch.full((dout,), 3.0, dtype=torch.float64), atol=0.03
    )
    expected = float((w_true**2).sum()) / (float((w_true**2).sum()) + dout * sigma**2)
    assert explained_variance(y[n:], x[n:] @ w + b) == pytest.approx(expected, abs=0.02)
    assert explained_variance(y[n:], y[n:].mean(0).expand_as(y[n:])) == pytest.approx(0.0, abs=1e-3)


def _snap(keys, values, positions, rope=None) -> KVSnapshot:
    t = keys[0].shape[2]
    return KVSnapshot(
        keys=tuple(keys),
        values=tuple(values),
        token_ids=torch.zeros(1, t, dtype=torch.long),
        positions=torch.as_tensor(positions),
        rope=rope,
        fingerprint="synthetic",
    )


def test_grid_finds_the_related_layer_and_per_layer_rope_is_removed():
    # Sharer: 3 layers x 2 heads x 8 dims of noise. Receiver layer j (1 head x 16 dims, with its own RoPE
    # per layer as in Gemma-3) is a linear function of sharer layer 2 - j only, plus 20% noise energy.
    gen = torch.Generator().manual_seed(1)
    ropes = [
        RopeSpec(inv_freq=tuple(1.0 / theta ** (np.arange(0, 16, 2) / 16)), head_dim=16, theta=theta)
        for theta in (1e4, 1e4, 1e6)
    ]
    ws = [torch.randn(16, 16, generator=gen, dtype=torch.float64) / 4 for _ in range(3)]
    src, dst = [], []
    for _ in range(6):
        pos = torch.arange(80) + int(torch.randint(0, 300, (1,), generator=gen))
        xk = [torch.randn(1, 2, 80, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
        xv = [torch.randn(1, 2, 80, 8, generator=gen, dtype=torch.float64) for _ in range(3)]

        def lin(x, j):
            flat = x[0].transpose(0, 1).flatten(1)  # [T, 16]
            y = flat @ ws[j]
            y = y + 0.5 * y.std() * torch.randn(y.shape, generator=gen, dtype=torch.float64)
            return y[None, None]  # [1, 1, T, 16]

        keys = [apply_rope(lin(xk[2 - j], j)[0], pos, ropes[j])[None] for j in range(3)]
        values = [lin(xv[2 - j], j) for j in range(3)]
        src.append(_snap(xk, xv, pos))
        dst.append(_snap(keys, values, pos))
    ev_k, ev_v = cache_map_grid(src[:4], dst[:4], src[4:], dst[4:], alpha=1e-6, dst_ropes=ropes)
    expected = 1 / 1.25
    for j in range(3):
        assert int(ev_k[:, j].argmax()) == 2 - j and int(ev_v[:, j].argmax()) == 2 - j
        assert ev_k[2 - j, j] == pytest.approx(expected, abs=0.05)
        assert ev_v[2 - j, j] == pytest.approx(expected, abs=0.05)
    assert np.delete(ev_v, [2, 4, 6]).max() < 0.05  # unrelated layer pairs explain nothing
    # without de-rotating the receiver's keys, the position-dependent rotation is not linear in the sharer
    raw_k, _ = cache_map_grid(src[:4], dst[:4], src[4:], dst[4:], alpha=1e-6)
    assert raw_k[2, 0] < 0.6 * ev_k[2, 0] and raw_k[1, 1] < 0.6 * ev_k[1, 1]  # local RoPE (theta 1e4)
    assert raw_k[0, 2] < ev_k[0, 2] - 0.2  # global RoPE (theta 1e6) rotates slowly: a smaller loss


def _tiny_pair(two_tokenizers, tiny_model):
    from kvlab.model.random import shrink_config, tiny_random_model

    word, char = two_tokenizers
    a = tiny_model("llama")
    big = tiny_random_model(a.config, seed=5, layers=3, head_dim=32, kv_heads=1, vocab=len(word))
    small = tiny_random_model(a.config, seed=6, layers=2, head_dim=16, kv_heads=2, vocab=len(char))
    assert shrink_config  # the helper exists; the models above differ in geometry and vocabulary
    return ModelHandle(small.model, char, name="tiny-char"), ModelHandle(big.model, word, name="tiny-word")


def test_cross_tokenizer_map_between_tiny_models(two_tokenizers, tiny_model):
    char_m, word_m = _tiny_pair(two_tokenizers, tiny_model)
    s, d, al = aligned_snapshots(char_m, word_m, TEXT, skip_first=1)
    assert s.seq_len == d.seq_len == len(al)
    assert d.positions.tolist() == list(al.dst_slots)  # original positions are kept for de-rotation
    cmap, grid, info = fit_cross_model_map(char_m, word_m, TEXTS[:4], TEXTS[4:], alpha=1e-2, grid=True)
    assert cmap.ev_k.shape == (3, 1) and grid is not None and grid[0].shape == (2, 3)
    assert np.isfinite(cmap.ev_k).all() and info["train_slots"] > 50
    assert cmap.needs_token_ids
    test_snap = char_m.prefill(TEXTS[4]).snapshot
    with pytest.raises(IncompatibleCacheError, match="span"):
        apply_cache_map(cmap, test_snap, word_m)
    mapped = apply_cache_map(cmap, test_snap, word_m, token_ids=[0] * test_snap.seq_len)
    assert mapped.fingerprint == word_m.fingerprint and mapped.num_kv_heads == 1
    # the same caches without an alignment: different lengths, a clear error
    from kvlab.ops.crossmodel import fit_cache_map

    full_c, full_w = char_m.prefill(TEXT).snapshot, word_m.prefill(TEXT).snapshot
    with pytest.raises(IncompatibleCacheError, match="span"):
        fit_cache_map([full_c], [full_w], [full_c], [full_w])


def test_transplant_across_tokenizers_needs_a_span_alignment(two_tokenizers, tiny_model):
    from kvlab.model.random import tiny_random_model

    word, char = two_tokenizers
    a = tiny_model("llama")
    m1 = tiny_random_model(a.config, seed=7, vocab=max(len(word), len(char)))
    m2 = tiny_random_model(a.config, seed=8, vocab=max(len(word), len(char)))
    h1, h2 = ModelHandle(m1.model, char, name="c"), ModelHandle(m2.model, word, name="w")
    snap = h1.prefill(TEXT).snapshot
    with pytest.raises(IncompatibleCacheError, match="span alignment"):
        transplant(snap, h1, h2)
