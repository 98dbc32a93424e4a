"""Scoring a model's output against a trial's answers: RULER's two string-match rules, made explicit.

Both sides are normalised first: lower case, every run of whitespace one space, ends stripped. An
answer *appears* in the output when its normalised text occurs there as a whole token run: not
preceded or followed by a letter or digit (so ``1234567`` is not found in ``12345678`` and ``data``
not in ``database``; RULER's plain substring test would count both — the one deliberate difference).

* ``all`` (RULER's ``string_match_all``): the fraction of the answers that appear — 1 when every one
  does, 0 when none does, partial credit in between. Used by the needle tasks (single, multi-key,
  multi-value), variable tracking and common-words extraction.
* ``part`` (RULER's ``string_match_part``): 1 when any of the answers appears (they are alternative
  spellings of one answer), else 0. Used by QA.

A wrong answer scores 0 and a right one 1 under both rules; only ``all`` with several answers gives
fractions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvlab.errors import BadInputError

RULES = ("all", "part")


def normalize(text: str) -> str:
    """Lower case, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.lower().split())


def appears(answer: str, output: str) -> bool:
    """Whether the normalised ``answer`` occurs in the normalised ``output`` as a whole token run."""
    a = normalize(answer)
    if not a:
        raise BadInputError("an empty answer cannot be scored")
    return re.search(rf"(?<![0-9a-z]){re.escape(a)}(?![0-9a-z])", normalize(output)) is not None


def _answers(answers: Sequence[str]) -> Sequence[str]:
    if isinstance(answers, str) or not answers:
        raise BadInputError("answers must be a non-empty list of strings")
    return answers


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """The fraction of ``answers`` that appear in ``output`` (RULER's ``string_match_all``)."""
    answers = _answers(answers)
    return sum(appears(a, output) for a in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """1.0 when any of ``answers`` appears in ``output``, else 0.0 (RULER's ``string_match_part``)."""
    return float(any(appears(a, output) for a in _answers(answers)))


def score(output: str, answers: Sequence[str], rule: str) -> float:
    """``output`` scored against ``answers`` by ``rule`` (``all`` or ``part``), in [0, 1]."""
    if rule == "all":
        return string_match_all(output, answers)
    if rule == "part":
        return string_match_part(output, answers)
    raise BadInputError(f"unknown scoring rule '{rule}'; choose one of {', '.join(RULES)}")
