"""RULER-style long-context tasks (Hsieh et al. 2024), generated offline, seeded and deterministic.

A task is one function ``make(encode, length_tokens, rng, haystack_text, knobs)`` registered with
:func:`task`; :data:`TASKS` holds them by name, :func:`make_trial` builds a :class:`Trial` from
``(task, tokenizer, length, seed, knobs)``. A :class:`Trial` is a ``context`` (what a cache policy
compresses) and a separate ``question`` (never compressed, as in kvpress), with the ``answers`` and the
scoring ``rule`` (:mod:`kvlab.eval.score`). ``length_tokens`` is the whole prompt, context plus
question, each tokenized on its own (RULER counts the whole input): the context is filled with
haystack words until one more word would pass the length, so a trial lands a few tokens under it.

The haystack is any text: kvlab's default long text (the Python documentation every machine has, or
Frankenstein where the shared books are present) or a user's file. A trial reads a seeded stretch of
it (wrapping round when the text is shorter than the trial, noted in ``meta``) and inserts its facts
at seeded depths, each at a sentence boundary near its depth.

Each task has difficulty knobs, RULER's own parameters (:attr:`Task.knobs` holds the defaults): the
needle tasks the number of keys (one asked, the others distractors), the values per key and the digits
of a value; variable tracking the hops of the chain and the number of chains; common words the number
of common words and their repeats against the rare words' (``common_repeats`` 0: today's rule, 4 to 30
by length); QA the number of people with a fact (one asked). The default knobs give the trials of every
published run token for token; :mod:`kvlab.eval.calibrate` chooses others per model and length.

The same ``(task, tokenizer, length, seed, haystack, knobs)`` gives the same trial on every machine:
every draw comes from a ``random.Random`` seeded by a string of the first four.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Mapping
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
    #: the knobs that differ from the task's defaults (empty: the default trial)
    knobs: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "length": self.length,
            "seed": self.seed,
            "answers": list(self.answers),
            "rule": self.rule,
            "meta": dict(self.meta),
            **({"knobs": dict(self.knobs)} if self.knobs else {}),
        }


Maker = Callable[[Encode, int, random.Random, str, Mapping[str, int]], tuple[str, str, list[str], dict]]


@dataclass(frozen=True)
class Task:
    """A registered task: its generator, scoring rule, answer budget (for ``answers`` answers: more answers,
    as knobs may ask, get as much more), one line of description and its knobs' defaults."""

    name: str
    maker: Maker
    rule: str
    max_new_tokens: int
    description: str
    knobs: Mapping[str, int] = field(default_factory=dict)
    answers: int = 1

    def resolve(self, knobs: Mapping[str, int] | None) -> dict[str, int]:
        """``knobs`` over the defaults, checked: known names, whole numbers (at least 1; 0 too for
        ``common_repeats``)."""
        out = dict(self.knobs)
        for name, value in (knobs or {}).items():
            if name not in out:
                raise BadInputError(
                    f"task '{self.name}' has no knob '{name}'; its knobs: {', '.join(self.knobs)}"
                )
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (0 if name == "common_repeats" else 1)
            ):
                raise BadInputError(f"task '{self.name}': knob {name}={value!r} must be a whole number >= 1")
            out[name] = value
        return out


#: every task by name, filled by :func:`task`
TASKS: dict[str, Task] = {}


def task(
    name: str, *, rule: str, max_new_tokens: int, knobs: Mapping[str, int] | None = None, answers: int = 1
) -> Callable[[Maker], Maker]:
    """Register ``fn(encode, length, rng, haystack_text, knobs) -> (context, question, answers, meta)`` as a
    task with the default ``knobs``, whose default trials have ``answers`` answers."""

    def register(fn: Maker) -> Maker:
        if name in TASKS:
            raise TypeError(f"two eval tasks are named '{name}'")
        doc = (fn.__doc__ or name).strip().splitlines()[0]
        TASKS[name] = Task(name, fn, rule, max_new_tokens, doc, dict(knobs or {}), answers)
        return fn

    return register


def encoder(tokenizer_or_handle: Any) -> Encode:
    """Text -> token ids without special tokens, from a ModelHandle (its tokenizer) or a tokenizer."""
    tok = getattr(tokenizer_or_handle, "tokenizer", tokenizer_or_handle)
    if tok is None or not callable(getattr(tok, "encode", None)):
        raise BadInputError("the eval tasks need a tokenizer (this model has none)")
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def trial_seed(seed: int, index: int) -> int:
    """The seed of trial ``index`` of a run seeded ``seed`` (trials of one run differ; runs repeat)."""
    return int(seed) * 100_003 + int(index)


def make_trial(
    name: str,
    tokenizer_or_handle: Any,
    length_tokens: int,
    seed: int,
    haystack_text: str | None = None,
    knobs: Mapping[str, int] | None = None,
) -> Trial:
    """One trial of task ``name`` of about ``length_tokens`` prompt tokens (context + question), at the
    task's default difficulty or with ``knobs`` (some of :attr:`Task.knobs`, the rest at their defaults)."""
    if name not in TASKS:
        raise BadInputError(f"unknown eval task '{name}'; choose one of {', '.join(TASKS)}")
    if int(length_tokens) < MIN_LENGTH:
        raise BadInputError(f"a trial needs at least {MIN_LENGTH} tokens, got {length_tokens}")
    if haystack_text is None:
        from kvlab.data import default_long_text

        haystack_text = default_long_text().text
    spec = TASKS[name]
    resolved = spec.resolve(knobs)
    rng = random.Random(f"kvlab.eval/{name}/{int(length_tokens)}/{int(seed)}")
    context, question, answers, meta = spec.maker(
        encoder(tokenizer_or_handle), int(length_tokens), rng, haystack_text, resolved
    )
    budget = max(spec.max_new_tokens, math.ceil(spec.max_new_tokens * len(answers) / spec.answers))
    changed = {k: v for k, v in resolved.items() if v != spec.knobs[k]}
    return Trial(
        name, context, question, answers, spec.rule, int(length_tokens), int(seed), budget, meta, changed
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


def _niah(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int], what: str):
    """RULER's needles: ``keys`` keys (one asked, the others distractors), each with ``values`` numbers of
    ``digits`` digits; every number of the asked key is asked (partial credit per number)."""
    n_keys, n_values = knobs["keys"], knobs["values"]
    keys, numbers = _keys(rng, n_keys), _numbers(rng, n_keys * n_values, knobs["digits"])
    ask = rng.randrange(n_keys) if n_keys > 1 else 0
    values = [numbers[i * n_values : (i + 1) * n_values] for i in range(n_keys)]
    needles = [_needle(k, v) for k, vs in zip(keys, values, strict=True) for v in vs]
    if n_keys > 1:
        rng.shuffle(needles)
    key = keys[ask]
    question = (
        _ask_one(key)
        if n_values == 1
        else f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        f"The special magic numbers for {key} mentioned in the provided text are"
    )
    context, meta = _haystack_context(encode, length, rng, text, NIAH_HEADER, needles, question, what)
    meta = {**meta, "key": key}
    if n_keys > 1:
        meta["distractor_keys"] = keys[:ask] + keys[ask + 1 :]
    return context, question, values[ask], meta


@task("niah_single", rule="all", max_new_tokens=24, knobs={"keys": 1, "values": 1, "digits": 7})
def niah_single(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """Single needle: one key's 7-digit magic number hidden in the haystack, asked at the end."""
    return _niah(encode, length, rng, text, knobs, "niah_single")


@task("niah_multikey", rule="all", max_new_tokens=24, knobs={"keys": 4, "values": 1, "digits": 7})
def niah_multikey(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """Multi-key needles: four keys with a number each (distractors); one key is asked."""
    return _niah(encode, length, rng, text, knobs, "niah_multikey")


@task(
    "niah_multivalue", rule="all", max_new_tokens=64, knobs={"keys": 1, "values": 4, "digits": 7}, answers=4
)
def niah_multivalue(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """Multi-value needles: one key with four numbers; every one is asked (partial credit per number)."""
    return _niah(encode, length, rng, text, knobs, "niah_multivalue")


def _interleave(chains: list[list[str]], rng: random.Random) -> list[str]:
    """The chains' statements merged in a random order that keeps each chain's own order (one chain: as is)."""
    if len(chains) == 1:
        return list(chains[0])
    order = [c for c, chain in enumerate(chains) for _ in chain]
    rng.shuffle(order)
    left = [iter(chain) for chain in chains]
    return [next(left[c]) for c in order]


@task("vt", rule="all", max_new_tokens=40, knobs={"hops": 4, "chains": 1}, answers=5)
def variable_tracking(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """Variable tracking: VAR X = 12345, then four hops VAR Y = VAR X ...; name every variable equal to the value."""
    per_chain, n_chains = knobs["hops"] + 1, knobs["chains"]
    names: list[str] = []
    while len(names) < per_chain * n_chains:
        name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
        if name not in names:
            names.append(name)
    values = _numbers(rng, n_chains, digits=5)  # the first is asked; the other chains are distractors
    chains = []
    for c, value in enumerate(values):
        chain = names[c * per_chain : (c + 1) * per_chain]
        chains.append(
            [f"VAR {chain[0]} = {value}."]
            + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
        )
    asked, value = names[:per_chain], values[0]
    header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variables assignment in the text above, {len(asked)} "
        f"variables are assigned the value {value}, they are:"
    )
    # depths are sorted, so each chain appears in order
    statements = _interleave(chains, rng)
    context, meta = _haystack_context(encode, length, rng, text, header, statements, question, "vt")
    return context, question, asked, {**meta, "value": value}


@task(
    "cwe",
    rule="all",
    max_new_tokens=64,
    knobs={"words": 10, "common_repeats": 0, "rare_repeats": 3},
    answers=10,
)
def common_words(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """Common-words extraction: a numbered word list where ten words repeat most often; name those ten."""
    pool = list(_vocabulary(text))
    if len(pool) < 200:
        raise BadInputError(f"the haystack has {len(pool)} distinct plain words; common-words needs 200")
    rng.shuffle(pool)
    n_common, rare_repeats = knobs["words"], knobs["rare_repeats"]
    common, rare = pool[:n_common], pool[n_common:]
    question = (
        f"\nQuestion: What are the {n_common} most common words in the above list? "
        f"Answer: The top {n_common} words that appear most often in the list are:"
    )
    header = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often."
    )
    budget = length - len(encode(question))
    per_entry = len(encode(" ".join(f"{i + 1}. {w}" for i, w in enumerate(rare[:50])))) / 50
    # by default the common words repeat 4 to 30 times (RULER: 30), keeping them to about a third of the
    # list; every other word appears 3 times
    repeats = knobs["common_repeats"] or min(30, max(4, int(budget / per_entry / 30)))
    if repeats <= rare_repeats:
        raise BadInputError(
            f"cwe: the common words must repeat more often ({repeats}) than the others ({rare_repeats})"
        )
    seed = rng.random()

    def build(n: int) -> str:
        if n > len(rare):
            raise BadInputError(
                f"the haystack has too few distinct words for a {length}-token common-words list"
            )
        entries = common * repeats + rare[:n] * rare_repeats
        random.Random(f"{seed}/{n}").shuffle(entries)
        return header + "\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)) + "\n"

    context, n = _fit(build, encode, budget, "cwe")
    return (
        context,
        question,
        common,
        {"common_repeats": repeats, "rare_words": n, "rare_repeats": rare_repeats},
    )


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


@task("qa", rule="part", max_new_tokens=16, knobs={"people": 4})
def qa(encode: Encode, length: int, rng: random.Random, text: str, knobs: Mapping[str, int]):
    """QA over the haystack: invented facts about four people are inserted; one fact is asked."""
    n = knobs["people"]
    if n > len(SURNAMES):
        raise BadInputError(f"qa: at most {len(SURNAMES)} people, got {n}")
    people = [f"{f} {s}" for f, s in zip(rng.sample(FIRST_NAMES, n), rng.sample(SURNAMES, n), strict=True)]
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
