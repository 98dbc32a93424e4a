"""Text for experiments, from what every machine has, plus the shared books when present.

The main job must run from the repository alone, so the default corpus is Python's own
documentation (``pydoc_data.topics``, ~470 KB of English prose shipped with every CPython). The
Project Gutenberg books and the UltraChat conversations in ``../shared/data`` are used when present
(tests, benchmarks, ``--text FILE``); every result says which source it came from.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import BadInputError
from kvlab.paths import shared_data_dir

# The Phase 1 log's three prompts.
PHASE1_PROMPTS = (
    "The meaning of consciousness is",
    "Hello, my name is Lyra and I",
    "When two AI systems communicate they",
)

# Unrelated control prompts written for kvlab (no relation to the study texts).
UNRELATED_PROMPTS = (
    "Preheat the oven to two hundred degrees, grease a tin, and whisk the eggs with sugar until pale.",
    "The tide tables for the northern harbour list two high waters each day, roughly twelve hours apart.",
    "Volcanic soils drain quickly and hold minerals that vineyards on the slopes have used for centuries.",
    "A chess opening that gives up a pawn early in exchange for rapid development is called a gambit.",
)


@dataclass(frozen=True)
class Text:
    """A text and where it came from (shown in reports)."""

    text: str
    source: str


def python_docs(min_chars: int = 0) -> Text:
    """Python's reference documentation as prose (topics joined, markup lines dropped)."""
    import pydoc_data.topics as topics

    parts = []
    for key in sorted(topics.topics):
        body = topics.topics[key]
        lines = [ln for ln in body.splitlines() if ln.strip() and not set(ln.strip()) <= set("*=-~^")]
        # Keep prose lines: drop grammar productions and indented code samples.
        prose = [ln.strip() for ln in lines if not ln.startswith("   ") and "::=" not in ln]
        parts.append(" ".join(prose))
    text = "\n\n".join(p for p in parts if p)
    text = re.sub(r"[ \t]+", " ", text)
    if len(text) < min_chars:
        raise BadInputError(f"the Python documentation has {len(text)} characters, fewer than {min_chars}")
    return Text(text=text, source="Python documentation (pydoc_data.topics, shipped with CPython)")


def read_text_file(path: str | Path) -> Text:
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"no text file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"{path} is not UTF-8 text") from None
    # Project Gutenberg books: keep the body between the START and END markers.
    start = re.search(r"\*\*\* ?START OF.*?\*\*\*", text)
    end = re.search(r"\*\*\* ?END OF", text)
    if start and end and end.start() > start.end():
        text = text[start.end() : end.start()]
    text = text.strip()
    if not text:
        raise BadInputError(f"{path} contains no text")
    return Text(text=text, source=f"{path.name}")


def shared_book(name: str) -> Text | None:
    """A book from ``../shared/data/texts`` (e.g. ``frankenstein``), or None where it is absent."""
    root = shared_data_dir()
    if root is None:
        return None
    path = root / "texts" / f"{name}.txt"
    return read_text_file(path) if path.is_file() else None


def default_long_text() -> Text:
    """Frankenstein where the shared books are present, else the Python documentation."""
    return shared_book("frankenstein") or python_docs()


def shared_conversations() -> list[dict] | None:
    """The ten UltraChat conversations (full / compacted / summary), or None where absent."""
    root = shared_data_dir()
    path = root / "ultrachat_compaction.json" if root else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def token_samples(ids: list[int], length: int, count: int, *, seed: int = 0) -> list[list[int]]:
    """``count`` samples of ``length`` tokens from ``ids``, evenly spread (non-overlapping when possible)."""
    if length < 1 or count < 1:
        raise BadInputError("sample length and count must be >= 1")
    if len(ids) < length:
        raise BadInputError(f"the text has {len(ids)} tokens, fewer than one sample of {length}")
    last = len(ids) - length
    if count == 1:
        starts = [0]
    else:
        step = last / (count - 1)
        starts = sorted({round(i * step) for i in range(count)})
        rng = random.Random(seed)
        while len(starts) < count:  # more samples than distinct starts: draw the rest
            starts.append(rng.randint(0, last))
    return [ids[s : s + length] for s in starts[:count]]
