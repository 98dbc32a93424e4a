"""The kvpress-style press: the context is compressed once (without the question), then the question
and answer run on the compressed cache, as kvpress's pipeline does."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.ops.press import Press
from kvlab.policy.evict import SnapKV, evict, kept_per_head, observe
from tests.layers_ref import logits_after_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = torch.randint(3, 500, (1, 60), generator=torch.Generator().manual_seed(11))
QUESTION = torch.tensor([[7, 8, 9, 10, 11]])


def test_no_compression_answers_like_the_plain_model(tiny_llama_2x64):
    h = tiny_llama_2x64
    got = Press("snapkv", compression_ratio=0.0).generate(h.model, CONTEXT, QUESTION, max_new_tokens=12)
    full = torch.cat([CONTEXT, QUESTION], dim=-1)
    plain = h.model.generate(full, max_new_tokens=12, do_sample=False)[0, full.shape[-1] :]
    assert got == plain.tolist()


def test_half_the_context_removed_equals_snapshot_eviction_of_the_context_alone(tiny_llama_2x64):
    h = tiny_llama_2x64
    press = Press(SnapKV(window=4, observe=4), compression_ratio=0.5)
    cache = press.cache(h.model)
    h.run(CONTEXT, cache)
    assert cache.held == 30 and cache.get_seq_length() == 60  # half kept, positions continue at 60
    ev = evict(observe(h, CONTEXT[0].tolist()), SnapKV(window=4, observe=4), keep=0.5)  # the question unseen
    first = press.generate(h, CONTEXT, QUESTION, max_new_tokens=1)  # a handle works as well
    ref = logits_after_layers(h, *kept_per_head(ev)[:2], QUESTION[0].tolist(), 60)
    assert first == [int(ref[-1].argmax())]
    assert first == [int(h.forward(QUESTION[0].tolist(), past=ev).logits[-1].argmax())]


def test_bad_presses_are_refused(tiny_llama_2x64):
    with pytest.raises(BadInputError, match="fraction removed"):
        Press("snapkv", compression_ratio=1.0)
    with pytest.raises(BadInputError, match="unknown eviction policy"):
        Press("snap", compression_ratio=0.5)
    with pytest.raises(BadInputError, match="non-empty"):
        Press("knorm", compression_ratio=0.5).generate(tiny_llama_2x64.model, CONTEXT, QUESTION[:, :0])
