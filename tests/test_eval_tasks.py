"""kvlab.eval.tasks and kvlab.eval.score: seeded RULER-style trials, and the stated scoring rules."""

from __future__ import annotations

import zlib

import pytest

from kvlab.data import python_docs
from kvlab.errors import BadInputError
from kvlab.eval.score import appears, normalize, score, string_match_all, string_match_part
from kvlab.eval.tasks import TASKS, Trial, encoder, make_trial, task


class WordTokenizer:
    """A deterministic stand-in tokenizer: one id per whitespace-separated word (a hash of the word, so
    the same on every run); decoding gives ``w<id>`` per token."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + zlib.crc32(w.encode()) % 499 for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{int(i)}" for i in ids)


HAYSTACK = python_docs().text


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("length", [256, 1024])
def test_trials_are_seeded_hit_the_length_and_hold_their_answers(name, length):
    tok = WordTokenizer()
    enc = encoder(tok)
    a = make_trial(name, tok, length, 3, HAYSTACK)
    assert a == make_trial(name, tok, length, 3, HAYSTACK)  # deterministic per seed
    assert a.context != make_trial(name, tok, length, 4, HAYSTACK).context  # another seed, another trial
    total = len(enc(a.context)) + len(enc(a.question))
    assert length - 16 <= total <= length, total
    assert isinstance(a, Trial) and a.task == name and a.answers and a.rule == TASKS[name].rule
    body = normalize(a.context)
    for ans in a.answers:
        assert appears(ans, body), (name, ans)
        assert (
            not appears(ans, a.question) or name == "vt"
        )  # vt's question names the value, not the variables
    if name == "niah_single":
        assert a.meta["key"] in a.question and f"for {a.meta['key']} is: {a.answers[0]}" in a.context
    if name == "niah_multikey":
        assert (
            all(k in a.context for k in a.meta["distractor_keys"])
            and len(set(a.meta["distractor_keys"])) == 3
        )
    if name == "niah_multivalue":
        assert len(a.answers) == 4 and a.context.count(a.meta["key"]) == 4
    if name == "vt":
        names = a.answers
        assert f"VAR {names[0]} = {a.meta['value']}." in a.context
        assert all(
            a.context.index(f"VAR {names[i]} ") < a.context.index(f"VAR {names[i + 1]} ") for i in range(4)
        )
    if name == "cwe":
        words = a.context.split()
        counts = {w: words.count(w) for w in set(words) if w.isalpha() and w.islower()}
        top = sorted(counts, key=lambda w: -counts[w])[:10]
        assert set(top) == set(a.answers) and min(counts[w] for w in a.answers) > 3
    if name == "qa":
        assert a.rule == "part" and a.meta["person"] in a.question


def test_the_default_haystack_is_used_without_one():
    tok = WordTokenizer()
    t = make_trial("niah_single", tok, 300, 0)
    assert "special magic number" in t.context and t.to_json()["answers"] == t.answers


def test_bad_inputs_are_refused():
    tok = WordTokenizer()
    with pytest.raises(BadInputError, match="unknown eval task"):
        make_trial("nope", tok, 512, 0, HAYSTACK)
    with pytest.raises(BadInputError, match="at least"):
        make_trial("niah_single", tok, 16, 0, HAYSTACK)
    with pytest.raises(BadInputError, match="50"):
        make_trial("niah_single", tok, 512, 0, "too short a haystack")
    with pytest.raises(BadInputError, match="tokenizer"):
        encoder(object())
    with pytest.raises(TypeError, match="two eval tasks"):
        task("qa", rule="part", max_new_tokens=4)(lambda *a: None)


def test_a_short_haystack_wraps_round():
    tok = WordTokenizer()
    small = " ".join(f"word{i}." for i in range(60))
    t = make_trial("niah_single", tok, 512, 0, small)
    assert t.meta["haystack_repeats"] is True


# -- scoring: hand cases -------------------------------------------------------------------------------
def test_normalize_and_appears():
    assert normalize("  The  Answer\n is\t42 ") == "the answer is 42"
    assert appears("Pelzorcor", " pelzorcor.")
    assert appears("New  York", "I think new york!")
    assert not appears("1234567", "12345678")  # a whole token run, not a substring of a longer number
    assert not appears("data", "database")
    assert appears("data", "the data, then")
    with pytest.raises(BadInputError):
        appears("  ", "x")


def test_string_match_all_gives_partial_credit():
    answers = ["1111111", "2222222", "3333333", "4444444"]
    assert string_match_all("1111111, 2222222, 3333333 and 4444444", answers) == 1.0
    assert string_match_all("1111111 and 3333333", answers) == 0.5
    assert string_match_all("2222222", answers) == 0.25
    assert string_match_all("nothing here", answers) == 0.0
    assert string_match_all(" 4502322.", ["4502322"]) == 1.0
    assert string_match_all(" 45232222.", ["4502322"]) == 0.0


def test_string_match_part_is_any():
    assert string_match_part("It was Brandorfel.", ["Brandorfel", "Brandorfel town"]) == 1.0
    assert string_match_part("It was Kesmor.", ["Brandorfel"]) == 0.0


def test_score_dispatches_on_the_rule():
    assert score("a b c", ["a", "z"], "all") == 0.5
    assert score("a b c", ["a", "z"], "part") == 1.0
    with pytest.raises(BadInputError, match="rule"):
        score("a", ["a"], "some")
    with pytest.raises(BadInputError):
        score("a", "a", "all")  # a bare string is not a list of answers
    with pytest.raises(BadInputError):
        score("a", [], "all")


@pytest.mark.real_model
def test_real_tokenizer_trials_hit_lengths(smollm):
    enc = encoder(smollm)
    for name in TASKS:
        t = make_trial(name, smollm, 512, 1)
        total = len(enc(t.context)) + len(enc(t.question))
        assert 512 - 24 <= total <= 512, (name, total)
        assert all(appears(a, t.context) for a in t.answers)
