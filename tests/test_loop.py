"""The one decode loop (kvlab.loop.decode_loop): picks, stops, feeding, sampling; and its users agree with it."""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.loop import Sampling, decode_loop

VOCAB = 11


def scripted_feed(script: dict[int, list[int]], fed: list[list[int]]):
    """A fake model: after row r has been fed k tokens, its next logits peak at ``script[r][k]``."""

    def feed(tokens: torch.Tensor) -> torch.Tensor:
        fed.append(tokens.tolist())
        out = torch.zeros(len(tokens), VOCAB)
        for r in range(len(tokens)):
            out[r, script[r][len(fed)]] = 1.0
        return out

    return feed


def one_hot(*ids: int) -> torch.Tensor:
    out = torch.zeros(len(ids), VOCAB)
    for r, i in enumerate(ids):
        out[r, i] = 1.0
    return out


def test_greedy_follows_logits_and_leaves_last_token_unfed():
    fed: list[list[int]] = []
    steps = list(decode_loop(scripted_feed({0: [0, 5, 6, 7, 8]}, fed), one_hot(4)[0], 4))
    assert [s.tokens[0] for s in steps] == [4, 5, 6, 7]
    assert fed == [[4], [5], [6]]  # the last pick is not fed
    assert [s.fed for s in steps] == [True, True, True, False]


def test_feed_last_feeds_every_token():
    fed: list[list[int]] = []
    steps = list(decode_loop(scripted_feed({0: [0, 5, 6]}, fed), one_hot(4), 2, feed_last=True))
    assert fed == [[4], [5]] and all(s.fed for s in steps)


def test_rows_stop_independently_and_the_stop_token_is_reported():
    fed: list[list[int]] = []
    script = {0: [0, 9, 1, 1, 1], 1: [0, 2, 3, 9, 1]}  # 9 is the stop token
    steps = list(decode_loop(scripted_feed(script, fed), one_hot(1, 1), 10, stop_ids=[9]))
    assert [s.tokens for s in steps] == [(1, 1), (9, 2), (None, 3), (None, 9)]
    assert steps[-1].stopped == (True, True) and not steps[-1].fed
    assert fed[2] == [9, 3]  # a stopped row is fed its last token while the other continues


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    a = [int(Sampling(1.0, seed=3).pick(logits, torch.Generator().manual_seed(3))) for _ in range(1)]
    b = [int(Sampling(1.0, seed=3).pick(logits, torch.Generator().manual_seed(3))) for _ in range(1)]
    assert a == b
    gen = torch.Generator().manual_seed(0)
    picks = {int(Sampling(1.0, top_p=0.7).pick(logits, gen)) for _ in range(300)}
    assert picks == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are outside the nucleus
    gen = torch.Generator().manual_seed(0)
    assert {int(Sampling(1.0, top_p=1e-9).pick(logits, gen)) for _ in range(50)} == {0}
    full = {int(Sampling(1.0).pick(logits, gen)) for _ in range(2000)}
    assert full == {0, 1, 2, 3}


def test_sampled_loop_repeats_with_the_same_seed():
    def feed(tokens):
        return torch.randn(len(tokens), VOCAB, generator=torch.Generator().manual_seed(int(tokens[0])))

    runs = [
        [s.tokens[0] for s in decode_loop(feed, torch.zeros(VOCAB), 20, sampling=Sampling(0.8, seed=s))]
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": float("nan")}]
)
def test_bad_sampling_is_refused(kwargs):
    with pytest.raises(BadInputError):
        Sampling(**kwargs)


def test_bad_length_is_refused():
    with pytest.raises(BadInputError, match="max_new_tokens"):
        next(decode_loop(lambda t: torch.zeros(1, VOCAB), torch.zeros(VOCAB), 0))


def test_generate_and_stream_generate_agree(tiny_model):
    """Two users of the loop, two cache kinds (snapshots, a live rolling cache): the same greedy text."""
    from kvlab.hf.rolling_cache import rolling_cache_for
    from kvlab.streaming import stream_generate
    from kvlab.streaming.generate import feed

    h = tiny_model("llama")
    prompt = list(range(5, 25))
    first = h.prefill(prompt, all_logits=False)
    gen = h.generate(first.snapshot, first.logits[-1], 12, stop_at_eos=False)
    cache = rolling_cache_for(h, window=64, sinks=4, evict_chunk=8)
    logits = feed(h, cache, prompt)
    streamed = [e.token_id for e in stream_generate(h, cache, logits, 12)]
    assert streamed == gen.token_ids
    assert gen.snapshot.seq_len == len(prompt) + 11  # the last token is never fed
    assert cache.tokens_seen == len(prompt) + 12  # stream_generate feeds every token it yields
