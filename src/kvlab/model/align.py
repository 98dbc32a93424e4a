"""Aligning two models' tokens by character spans, so caches of different tokenizers can be compared.

Two tokenizers cut the same text differently, so slot ``t`` of one model's cache and slot ``t`` of
another's hold different pieces of text. Where both tokenizers end a token at the same character
(a shared word boundary: "Seattle" is one token in one model and "Se" + "attle" in the other, but
both end after the "e"), the two slots have read exactly the same text. :func:`align_by_spans` pairs
those tokens using the tokenizers' offset mappings; :func:`aligned_snapshots` prefills both models
and keeps only the paired slots, giving two caches of equal length whose slot ``t`` covers the
same prefix of the text: the input a cross-model ridge map (:func:`kvlab.ops.crossmodel.fit_cross_model_map`) needs.

Tokens the tokenizer adds (BOS, which Gemma adds and SmolLM does not) cover no characters and are
never paired.
Slots keep their original positions, so keys are de-rotated at the right angle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvlab.cache.snapshot import KVSnapshot
from kvlab.errors import BadInputError


@dataclass(frozen=True)
class SpanAlignment:
    """Token pairs of two tokenizations of ``text`` that end at the same character."""

    text: str
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    src_slots: tuple[int, ...]  # index into src_ids of each pair
    dst_slots: tuple[int, ...]
    char_ends: tuple[int, ...]  # the shared end offset of each pair

    def __len__(self) -> int:
        return len(self.src_slots)

    @property
    def coverage(self) -> tuple[float, float]:
        """Fraction of each side's tokens that were paired."""
        return len(self) / max(1, len(self.src_ids)), len(self) / max(1, len(self.dst_ids))


def token_spans(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids (special tokens included, as the model sees them) and each token's character span."""
    if tokenizer is None:
        raise BadInputError("span alignment needs models with tokenizers (token ids alone carry no text)")
    if not isinstance(text, str) or not text.strip():
        raise BadInputError("empty text: give at least one non-blank character")
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError) as exc:
        raise BadInputError(
            f"this tokenizer ({type(tokenizer).__name__}) cannot report character offsets, "
            "which span alignment needs (use a fast tokenizer)"
        ) from exc
    ids = [int(i) for i in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    return ids, offsets


def _ends(offsets: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Character end -> the last token ending there (byte-level pieces of one character share an end)."""
    out: dict[int, int] = {}
    for i, (a, b) in enumerate(offsets):
        if b > a:  # added special tokens (BOS) cover no text
            out[b] = i
    return out


def align_by_spans(
    src_tokenizer: Any, dst_tokenizer: Any, text: str, *, skip_first: int = 0
) -> SpanAlignment:
    """Pair the tokens of ``text`` whose character end offsets coincide under both tokenizers.

    ``skip_first`` drops pairs inside the first ``skip_first`` text tokens of either side (the first
    text token is an attention sink in models without BOS; its cache is not typical of the rest).
    Raises :class:`BadInputError` when fewer than two tokens align.
    """
    s_ids, s_off = token_spans(src_tokenizer, text)
    d_ids, d_off = token_spans(dst_tokenizer, text)
    s_end, d_end = _ends(s_off), _ends(d_off)
    s_text = [i for i, (a, b) in enumerate(s_off) if b > a]
    d_text = [i for i, (a, b) in enumerate(d_off) if b > a]
    s_min = s_text[skip_first] if skip_first < len(s_text) else len(s_ids)
    d_min = d_text[skip_first] if skip_first < len(d_text) else len(d_ids)
    ends = sorted(e for e in s_end.keys() & d_end.keys() if s_end[e] >= s_min and d_end[e] >= d_min)
    if len(ends) < 2:
        raise BadInputError(
            f"only {len(ends)} token boundaries are shared by the two tokenizers on this text; give a longer text"
        )
    return SpanAlignment(
        text=text,
        src_ids=tuple(s_ids),
        dst_ids=tuple(d_ids),
        src_slots=tuple(s_end[e] for e in ends),
        dst_slots=tuple(d_end[e] for e in ends),
        char_ends=tuple(ends),
    )


def aligned_snapshots(
    src: Any, dst: Any, text: str, *, skip_first: int = 1
) -> tuple[KVSnapshot, KVSnapshot, SpanAlignment]:
    """Prefill ``text`` in both models (ModelHandles) and keep only the span-aligned slots of each cache.

    The two returned snapshots have equal length; slot ``t`` of each has read the same characters.
    Positions are kept (not re-numbered), so keys stay de-rotatable. Texts must fit both models'
    windows (Gemma-3's sliding layers hold 512 tokens; kvlab refuses longer sequences).
    """
    al = align_by_spans(src.tokenizer, dst.tokenizer, text, skip_first=skip_first)
    s = src.prefill(list(al.src_ids)).snapshot.select(list(al.src_slots))
    d = dst.prefill(list(al.dst_ids)).snapshot.select(list(al.dst_slots))
    return s, d, al
