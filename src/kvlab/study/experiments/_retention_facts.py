"""Fact/question pairs written for kvlab, and the chat-template episodes the retention experiments feed.

An episode is a conversation cut into token pieces at turn boundaries, so each piece can be cached
and moved on its own:

    P  preamble    <|im_start|>system ... <|im_end|>           (the template's default system prompt)
    A  fact turn   <|im_start|>user <statement> <|im_end|> + a short assistant acknowledgement
    B  question    <|im_start|>user <question> <|im_end|> <|im_start|>assistant <response prefix>
    answer         the answer's tokens (" Lyra"), scored by teacher forcing

The pieces are tokenized separately; the builder checks that their concatenation is exactly the
tokenization of the whole rendered conversation, so "text" and "cache" conditions see the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlab.errors import BadInputError, UnsupportedModelError


def _facts(table: str) -> tuple[tuple[str, str, str, str], ...]:
    """One fact a line, ``statement | question | response prefix | answer``, as FACTS' tuples."""
    out = []
    for line in table.strip().splitlines():
        statement, question, prefix, answer = line.split(" | ")
        out.append((statement, question, prefix, answer))
    return tuple(out)


#: (statement, question, response prefix, answer). Answers are single words or numbers.
FACTS: tuple[tuple[str, str, str, str], ...] = _facts(
    """
Hello, my name is Lyra and I live in Seattle. | What is my name? | Your name is | Lyra
Hi there, I'm Tobias and I work as a baker. | What is my name? | Your name is | Tobias
My name is Priya. I grew up near the coast. | What is my name? | Your name is | Priya
Call me Oswin, that is the name I go by. | What is my name? | Your name is | Oswin
I am Marguerite and I teach chemistry. | What is my name? | Your name is | Marguerite
Everyone calls me Dmitri at the office. | What is my name? | Your name is | Dmitri
I live in Lisbon, in a flat by the river. | Which city do I live in? | You live in | Lisbon
My home is in Nairobi, close to the park. | Which city do I live in? | You live in | Nairobi
I moved to Montreal last spring. | Which city do I live in? | You live in | Montreal
These days I live in Osaka with my sister. | Which city do I live in? | You live in | Osaka
I have lived in Edinburgh for ten years. | Which city do I live in? | You live in | Edinburgh
My apartment is in Santiago, on the fifth floor. | Which city do I live in? | You live in | Santiago
My favourite colour is green. | What is my favourite colour? | Your favourite colour is | green
I love the colour purple more than any other. | What is my favourite colour? | Your favourite colour is | purple
The colour I like best is orange. | What is my favourite colour? | Your favourite colour is | orange
My favourite colour has always been yellow. | What is my favourite colour? | Your favourite colour is | yellow
Of all colours, I like blue the most. | What is my favourite colour? | Your favourite colour is | blue
My locker number is 47. | What is my locker number? | Your locker number is | 47
The code for my bike lock is 3921. | What is the code for my bike lock? | The code for your bike lock is | 3921
I am 63 years old. | How old am I? | You are | 63
My flight leaves from gate 18. | Which gate does my flight leave from? | Your flight leaves from gate | 18
My room number at the hotel is 512. | What is my room number? | Your room number is | 512
My house is number 29 on the street. | What is my house number? | Your house number is | 29
My dog is called Biscuit. | What is my dog called? | Your dog is called | Biscuit
I have a cat named Pepper. | What is my cat's name? | Your cat's name is | Pepper
My favourite fruit is the mango. | What is my favourite fruit? | Your favourite fruit is | mango
I play the cello in an orchestra. | Which instrument do I play? | You play the | cello
I drive a red Volvo to work. | What brand of car do I drive? | You drive a | Volvo
My sister is named Clara. | What is my sister's name? | Your sister's name is | Clara
I was born in Norway. | Which country was I born in? | You were born in | Norway
My favourite sport is tennis. | What is my favourite sport? | Your favourite sport is | tennis
I speak Portuguese at home. | Which language do I speak at home? | At home you speak | Portuguese
My best friend is called Ravi. | What is my best friend called? | Your best friend is called | Ravi
I work as a nurse at the hospital. | What is my job? | You work as a | nurse
"""
)

ACK = "Noted."
_MARK = "\u2063KVLAB\u2063"  # a sentinel that no template or prompt contains
OTHER_SYSTEM = "You are a careful assistant for a travel agency. Keep every answer short and polite."
NEUTRAL = (
    "The tide tables for the northern harbour list two high waters each day, roughly twelve hours apart, "
    "and the ferry timetable changes with them through the year."
)


@dataclass(frozen=True)
class Episode:
    """Token pieces of one fact/question conversation (see module docstring)."""

    preamble: list[int]
    other_preamble: list[int]
    fact: list[int]
    neutral_fact: list[int]  # same length as ``fact``: the fact's words replaced by neutral text
    question: list[int]
    answer: list[int]


def _render(tok: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def build_episodes(model: Any, n: int | None = None, seed: int = 0) -> list[Episode]:
    """Token pieces for ``n`` facts (all by default) using the model's chat template: the first ``n`` for
    seed 0, else ``n`` drawn by the seed (:func:`~kvlab.study.experiments._sampling.seeded_order`)."""
    from kvlab.study.experiments._sampling import seeded_order

    tok = model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise UnsupportedModelError(
            "the retention experiments need a model with a tokenizer and a chat template"
        )

    def enc(text: str) -> list[int]:
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]

    # The default system prompt, as the template renders it for a conversation without one.
    user_prefix = _user_prefix(tok)
    probe = _render(tok, [{"role": "user", "content": _MARK}], False)
    other = _render(
        tok, [{"role": "system", "content": OTHER_SYSTEM}, {"role": "user", "content": _MARK}], False
    )
    pre_text = probe[: probe.index(_MARK) - len(user_prefix)]
    other_pre_text = other[: other.index(_MARK) - len(user_prefix)]
    neutral_ids = enc(NEUTRAL)
    episodes = []
    chosen = [FACTS[i] for i in seeded_order(len(FACTS), seed)[:n]]
    for statement, question, prefix, answer in chosen:
        msgs = [
            {"role": "user", "content": statement},
            {"role": "assistant", "content": ACK},
            {"role": "user", "content": question},
        ]
        whole = _render(tok, msgs, True) + prefix
        fact_text = _render(tok, msgs[:2], False)[len(pre_text) :]
        q_text = whole[len(pre_text) + len(fact_text) :]
        pieces = [enc(pre_text), enc(fact_text), enc(q_text)]
        if sum(pieces, []) != enc(whole):
            raise UnsupportedModelError(
                "this tokenizer merges tokens across chat turns; the episode cannot be cut at turns"
            )
        head, tail = enc(user_prefix), enc(fact_text[fact_text.index(statement) + len(statement) :])
        body = len(pieces[1]) - len(head) - len(tail)
        if (
            pieces[1][: len(head)] != head
            or pieces[1][len(pieces[1]) - len(tail) :] != tail
            or body > len(neutral_ids)
        ):
            raise UnsupportedModelError("cannot build a same-length neutral fact turn for this chat template")
        neutral = head + neutral_ids[:body] + tail
        episodes.append(
            Episode(
                preamble=pieces[0],
                other_preamble=enc(other_pre_text),
                fact=pieces[1],
                neutral_fact=neutral,
                question=pieces[2],
                answer=enc(" " + answer),
            )
        )
    if not episodes:
        raise BadInputError("no facts selected; n must be >= 1")
    return episodes


def _user_prefix(tok: Any) -> str:
    """The text the template puts before a user message's content (e.g. ``<|im_start|>user\\n``)."""
    a = _render(tok, [{"role": "system", "content": "s"}, {"role": "user", "content": _MARK}], False)
    b = _render(tok, [{"role": "system", "content": "s"}], False)
    return a[len(b) : a.index(_MARK, len(b))]


@dataclass(frozen=True)
class Score:
    exact: bool  # greedy decoding would produce exactly the answer's tokens
    nll: float  # nats, summed over the answer's tokens
    logits: Any  # [len(answer), vocab] float32, the logits that predict each answer token


def score_answer(model: Any, past: Any, episode: Episode) -> Score:
    """Feed the question (+ all but the last answer token) after ``past`` and score the answer by teacher forcing.

    ``exact`` is true iff the argmax at every answer position is the answer's token: exactly when
    greedy decoding from this cache would emit the answer (before the first miss, greedy and
    teacher-forced prefixes are identical).
    """
    import torch

    from kvlab.metrics import nll

    feed = episode.question + episode.answer[:-1]
    out = model.forward(feed, past) if past is not None else model.prefill(feed)
    return _score_logits(out.logits[len(episode.question) - 1 :], episode, torch, nll)


def score_answers(model: Any, pasts: list[Any], episode: Episode) -> list[Score]:
    """:func:`score_answer` for many caches of one length and positions, as one batched forward."""
    from kvlab.cache import stack_rows

    if len(pasts) == 1:
        return [score_answer(model, pasts[0], episode)]
    import torch

    from kvlab.metrics import nll

    feed = episode.question + episode.answer[:-1]
    out = model.forward([feed] * len(pasts), stack_rows(pasts))
    start = len(episode.question) - 1
    return [_score_logits(out.logits[b, start:], episode, torch, nll) for b in range(len(pasts))]


def score_answers_grouped(model: Any, pasts: dict[str, Any], episode: Episode) -> dict[str, Score]:
    """:func:`score_answer` for named caches; those with equal length and positions share one batch."""
    from kvlab.cache import batchable_groups

    out: dict[str, Score] = {}
    for names in batchable_groups(pasts):
        out.update(zip(names, score_answers(model, [pasts[n] for n in names], episode), strict=True))
    return {name: out[name] for name in pasts}


def score_text(model: Any, context: list[int], episode: Episode) -> Score:
    """The same score with ``context`` as text: one prefill of context + question + answer."""
    import torch

    from kvlab.metrics import nll

    out = model.prefill(context + episode.question + episode.answer[:-1])
    return _score_logits(out.logits[len(context) + len(episode.question) - 1 :], episode, torch, nll)


def _score_logits(logits: Any, episode: Episode, torch: Any, nll: Any) -> Score:
    target = torch.tensor(episode.answer, device=logits.device)
    exact = bool((logits.argmax(-1) == target).all())
    return Score(exact=exact, nll=float(nll(logits, target).sum()), logits=logits)
