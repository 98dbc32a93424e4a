"""RULER-style long-context tasks (Hsieh et al. 2024), generated offline, seeded and deterministic.

A task is one function ``make(tokenizer, length_tokens, seed, haystack_text) -> Trial`` registered with
:func:`task`; :data:`TASKS` holds them by name. A :class:`Trial` is a ``context`` (what a cache policy
compresses) and a separate ``question`` (never compressed, as in kvpress), with the ``answers`` and the
scoring ``rule`` (:mod:`kvlab.eval.score`). ``length_tokens`` is the whole prompt, context plus
question, each tokenized on its own (RULER counts the whole input): the context is filled with
haystack words until one more word would pass the length, so a trial lands a few tokens under it.

The haystack is any text: kvlab's default long text (the Python documentation every machine has, or
Frankenstein where the shared books are present) or a user's file. A trial reads a seeded stretch of
it (wrapping round when the text is shorter than the trial, noted in ``meta``) and inserts its facts
at seeded depths, each at a sentence boundary near its depth.

The same ``(task, tokenizer, length, seed, haystack)`` gives the same trial on every machine: every
draw comes from a ``random.Random`` seeded by a string of those values.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvlab.errors import BadInputError

Encode = Callable[[str], list[int]]

#: The shortest prompt a trial is built for (headers, needles and the question need room).
MIN_LENGTH = 128


@dataclass(frozen=True)
class Trial:
    """One question over one context. ``rule`` is how :func:`kvlab.eval.score.score` compares the output
    to ``answers``; ``meta`` records what was drawn (depths, keys, where the haystack starts)."""

    task: str
    context: str
    question: str
    answers: list[str]
    rule: str
    length: int
    seed: int
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "length": self.length,
            "seed": self.seed,
            "answers": list(self.answers),
            "rule": self.rule,
            "meta": dict(self.meta),
        }


Maker = Callable[[Encode, int, random.Random, str], tuple[str, str, list[str], dict]]


@dataclass(frozen=True)
class Task:
    """A registered task: its generator, scoring rule, answer budget and one line of description."""

    name: str
    maker: Maker
    rule: str
    max_new_tokens: int
    description: str


#: every task by name, filled by :func:`task`
TASKS: dict[str, Task] = {}


def task(name: str, *, rule: str, max_new_tokens: int) -> Callable[[Maker], Maker]:
    """Register ``fn(encode, length, rng, haystack_text) -> (context, question, answers, meta)`` as a task."""

    def register(fn: Maker) -> Maker:
        if name in TASKS:
            raise TypeError(f"two eval tasks are named '{name}'")
        doc = (fn.__doc__ or name).strip().splitlines()[0]
        TASKS[name] = Task(name, fn, rule, max_new_tokens, doc)
        return fn

    return register


def encoder(tokenizer_or_handle: Any) -> Encode:
    """Text -> token ids without special tokens, from a ModelHandle (its tokenizer) or a tokenizer."""
    tok = getattr(tokenizer_or_handle, "tokenizer", tokenizer_or_handle)
    if tok is None or not callable(getattr(tok, "encode", None)):
        raise BadInputError("the eval tasks need a tokenizer (this model has none)")
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def make_trial(
    name: str, tokenizer_or_handle: Any, length_tokens: int, seed: int, haystack_text: str | None = None
) -> Trial:
    """One trial of task ``name`` of about ``length_tokens`` prompt tokens (context + question)."""
    if name not in TASKS:
        raise BadInputError(f"unknown eval task '{name}'; choose one of {', '.join(TASKS)}")
    if int(length_tokens) < MIN_LENGTH:
        raise BadInputError(f"a trial needs at least {MIN_LENGTH} tokens, got {length_tokens}")
    if haystack_text is None:
        from kvlab.data import default_long_text

        haystack_text = default_long_text().text
    spec = TASKS[name]
    rng = random.Random(f"kvlab.eval/{name}/{int(length_tokens)}/{int(seed)}")
    context, question, answers, meta = spec.maker(
        encoder(tokenizer_or_handle), int(length_tokens), rng, haystack_text
    )
    return Trial(
        name, context, question, answers, spec.rule, int(length_tokens), int(seed), spec.max_new_tokens, meta
    )


# -- words and names (fixed lists: no network, the same everywhere) ------------------------------------
def _split(words: str) -> tuple[str, ...]:
    return tuple(words.split())


ADJECTIVES = _split(
    "amber brave calm dusty eager faint gentle hollow icy jolly keen lively misty noble odd pale quiet "
    "rapid silent tidy upper vivid wary young zesty bitter crisp dark early fresh grand humble lucky "
    "mellow narrow polite proud rough sharp smooth steady sweet thin warm wild wise"
)
NOUNS = _split(
    "anchor badger candle dolphin ember falcon garden harbor island jacket kettle lantern meadow "
    "needle orchard pebble quarry river saddle temple umbrella valley walnut yacht zebra bridge "
    "castle desert forest glacier hammer ladder mirror pepper rocket shadow spider tunnel violin window"
)
FIRST_NAMES = _split(
    "Alma Bruno Celia Dorian Edda Felix Greta Hugo Ines Jonah Klara Lionel Mira Nils Odile Piet "
    "Rosa Silas Tilde Ugo Vera Wendel Xenia Yannick Zora"
)
SURNAMES = _split(
    "Abernathy Brackwell Corrigan Dunmore Elsworth Fairbairn Gallow Hartigan Ivers Jessop Kilbride "
    "Lorrimer Merriweather Northcott Ormsby Penhallow Quigley Rutherby Standish Thornbury Underhill "
    "Vexley Whitlock Yarborough"
)
_SYLLABLES = _split("bran dor fel gar hol kes lin mor nor pel quen ros tal ven wick zor ash bel cor dun")
INSTRUMENTS = _split(
    "accordion bassoon cello clarinet dulcimer harp harpsichord marimba oboe sitar trombone tuba ukulele viola"
)


def _town(rng: random.Random) -> str:
    return "".join(rng.sample(_SYLLABLES, 3)).capitalize()


# -- haystacks --------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def _words(text: str) -> tuple[str, ...]:
    words = tuple(text.split())
    if len(words) < 50:
        raise BadInputError(f"the haystack has {len(words)} words; give a text of at least 50")
    return words


@lru_cache(maxsize=4)
def _vocabulary(text: str) -> tuple[str, ...]:
    """Distinct plain lower-case words of 4 to 10 letters in ``text``, sorted (common-words' pool)."""
    return tuple(sorted({w for w in re.findall(r"[A-Za-z]+", text.lower()) if 4 <= len(w) <= 10}))


def _stream(words: tuple[str, ...], start: int, n: int) -> list[str]:
    return [words[(start + i) % len(words)] for i in range(n)]


def _insert(filler: list[str], facts: list[tuple[float, str]]) -> str:
    """``filler`` words with each fact inserted near its depth (0..1), after the sentence end before it."""
    cuts = []
    for depth, fact in facts:
        i = round(depth * len(filler))
        j = i
        while j > 0 and i - j < 60 and not filler[j - 1].endswith((".", "!", "?")):
            j -= 1
        cuts.append((j if j > 0 and i - j < 60 else i, fact))
    out: list[str] = []
    prev = 0
    for at, fact in sorted(cuts, key=lambda c: c[0]):  # stable: facts at one cut keep their order
        out += filler[prev:at]
        out.append(fact)
        prev = at
    out += filler[prev:]
    return " ".join(out)


def _fit(build: Callable[[int], str], encode: Encode, budget: int, what: str) -> tuple[str, int]:
    """The largest ``n`` whose ``build(n)`` takes at most ``budget`` tokens (binary search), and its text."""

    def size(n: int) -> int:
        return len(encode(build(n)))

    if size(0) > budget:
        raise BadInputError(
            f"{what}: the instructions, facts and question alone take more than the {budget} tokens "
            "this length leaves; give a longer length"
        )
    lo, hi = 0, max(8, budget)
    while size(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return build(lo), lo


def _haystack_context(
    encode: Encode,
    length: int,
    rng: random.Random,
    text: str,
    header: str,
    facts: list[str],
    question: str,
    what: str,
) -> tuple[str, dict]:
    """``header`` + a seeded stretch of ``text`` with ``facts`` at sorted random depths, filling the length."""
    words = _words(text)
    start = rng.randrange(len(words))
    depths = sorted(rng.uniform(0.05, 0.95) for _ in facts)
    placed = list(zip(depths, facts, strict=True))
    budget = length - len(encode(question))
    context, n = _fit(
        lambda n: f"{header}\n\n{_insert(_stream(words, start, n), placed)}\n", encode, budget, what
    )
    return context, {
        "haystack_start_word": start,
        "haystack_words": n,
        "haystack_repeats": n > len(words),
        "depths": depths,
    }


def _numbers(rng: random.Random, count: int, digits: int = 7) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), count)]


def _keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], count)
    return [f"{a}-{n}" for a, n in pairs]


NIAH_HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask_one(key: str) -> str:
    return (
        f"\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )


@task("niah_single", rule="all", max_new_tokens=24)
def niah_single(encode: Encode, length: int, rng: random.Random, text: str):
    """Single needle: one key's 7-digit magic number hidden in the haystack, asked at the end."""
    (key,), (value,) = _keys(rng, 1), _numbers(rng, 1)
    question = _ask_one(key)
    context, meta = _haystack_context(
        encode, length, rng, text, NIAH_HEADER, [_needle(key, value)], question, "niah_single"
    )
    return context, question, [value], {**meta, "key": key}


@task("niah_multikey", rule="all", max_new_tokens=24)
def niah_multikey(encode: Encode, length: int, rng: random.Random, text: str):
    """Multi-key needles: four keys with a number each (distractors); one key is asked."""
    keys, values = _keys(rng, 4), _numbers(rng, 4)
    ask = rng.randrange(4)
    needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
    rng.shuffle(needles)
    question = _ask_one(keys[ask])
    context, meta = _haystack_context(
        encode, length, rng, text, NIAH_HEADER, needles, question, "niah_multikey"
    )
    return (
        context,
        question,
        [values[ask]],
        {**meta, "key": keys[ask], "distractor_keys": keys[:ask] + keys[ask + 1 :]},
    )


@task("niah_multivalue", rule="all", max_new_tokens=64)
def niah_multivalue(encode: Encode, length: int, rng: random.Random, text: str):
    """Multi-value needles: one key with four numbers; every one is asked (partial credit per number)."""
    (key,), values = _keys(rng, 1), _numbers(rng, 4)
    question = (
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        f"The special magic numbers for {key} mentioned in the provided text are"
    )
    needles = [_needle(key, v) for v in values]
    context, meta = _haystack_context(
        encode, length, rng, text, NIAH_HEADER, needles, question, "niah_multivalue"
    )
    return context, question, values, {**meta, "key": key}


@task("vt", rule="all", max_new_tokens=40)
def variable_tracking(encode: Encode, length: int, rng: random.Random, text: str):
    """Variable tracking: VAR X = 12345, then four hops VAR Y = VAR X ...; name every variable equal to the value."""
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names:
            names.append(name)
    (value,) = _numbers(rng, 1, digits=5)
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)
    ]
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variables assignment in the text above, {len(names)} "
        f"variables are assigned the value {value}, they are:"
    )
    # depths are sorted, so the chain appears in order
    context, meta = _haystack_context(encode, length, rng, text, header, chain, question, "vt")
    return context, question, names, {**meta, "value": value}


@task("cwe", rule="all", max_new_tokens=64)
def common_words(encode: Encode, length: int, rng: random.Random, text: str):
    """Common-words extraction: a numbered word list where ten words repeat most often; name those ten."""
    pool = list(_vocabulary(text))
    if len(pool) < 200:
        raise BadInputError(f"the haystack has {len(pool)} distinct plain words; common-words needs 200")
    rng.shuffle(pool)
    common, rare = pool[:10], pool[10:]
    question = (
        "\nQuestion: What are the 10 most common words in the above list? "
        "Answer: The top 10 words that appear most often in the list are:"
    )
    header = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    budget = length - len(encode(question))
    per_entry = len(encode(" ".join(f"{i + 1}. {w}" for i, w in enumerate(rare[:50])))) / 50
    # the common words repeat 4 to 30 times (RULER: 30), keeping them to about a third of the list;
    # every other word appears 3 times
    repeats = min(30, max(4, int(budget / per_entry / 30)))
    seed = rng.random()

    def build(n: int) -> str:
        if n > len(rare):
            raise BadInputError(
                f"the haystack has too few distinct words for a {length}-token common-words list"
            )
        entries = common * repeats + rare[:n] * 3
        random.Random(f"{seed}/{n}").shuffle(entries)
        return header + "\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)) + "\n"

    context, n = _fit(build, encode, budget, "cwe")
    return context, question, common, {"common_repeats": repeats, "rare_words": n, "rare_repeats": 3}


_FACTS = (
    ("{name} was born in the town of {x}.", "In which town was {name} born?"),
    ("The favourite instrument of {name} is the {x}.", "Which instrument does {name} like best?"),
    ("{name} keeps a pet tortoise called {x}.", "What is the name of {name}'s pet tortoise?"),
)
_FACT_KINDS = ("town", "instrument", "pet")


def _fact_value(kind: str, rng: random.Random) -> str:
    if kind == "instrument":
        return rng.choice(INSTRUMENTS)
    if kind == "pet":
        return rng.choice(FIRST_NAMES)
    return _town(rng)


@task("qa", rule="part", max_new_tokens=16)
def qa(encode: Encode, length: int, rng: random.Random, text: str):
    """QA over the haystack: invented facts about four people are inserted; one fact is asked."""
    people = [f"{f} {s}" for f, s in zip(rng.sample(FIRST_NAMES, 4), rng.sample(SURNAMES, 4), strict=True)]
    facts, answer, asked, lead = [], "", "", ""
    for i, person in enumerate(people):
        which = rng.randrange(len(_FACTS))
        template, q = _FACTS[which]
        value = _fact_value(_FACT_KINDS[which], rng)
        facts.append(template.format(name=person, x=value))
        if i == 0:  # the answer is asked for in the fact's own words, to be completed (as the needles are)
            answer, asked, lead = value, q.format(name=person), template.split("{x}")[0].format(name=person)
    rng.shuffle(facts)
    header = "Read the following text. A question about a fact stated in it follows."
    question = (
        "\nAnswer the question based on the text above. Only give the answer and do not output any other words."
        f"\n\nQuestion: {asked}\nAnswer: {lead.strip()}"
    )
    context, meta = _haystack_context(encode, length, rng, text, header, facts, question, "qa")
    return context, question, [answer], {**meta, "person": people[0]}
