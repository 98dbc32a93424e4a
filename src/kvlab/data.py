"""Text for experiments, from what every machine has, plus the shared books when present.

The main job must run from the repository alone, so the default corpus is Python's own
documentation (``pydoc_data.topics``, ~470 KB of English prose shipped with every CPython). The
Project Gutenberg books and the UltraChat conversations in ``../shared/data`` are used when present
(tests, benchmarks, ``--text FILE``); every result says which source it came from.
"""

from __future__ import annotations

import json
import os
import random
import re
import stat
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


def _prose_lines(body: str) -> list[str]:
    """The prose lines of one documentation topic: no underlines, grammar productions or indented code."""
    lines = [ln for ln in body.splitlines() if ln.strip() and not set(ln.strip()) <= set("*=-~^")]
    return [ln.strip() for ln in lines if not ln.startswith("   ") and "::=" not in ln]


def python_docs(min_chars: int = 0) -> Text:
    """Python's reference documentation as prose (topics joined, markup lines dropped)."""
    import pydoc_data.topics as topics

    parts = [" ".join(_prose_lines(topics.topics[key])) for key in sorted(topics.topics)]
    text = "\n\n".join(p for p in parts if p)
    text = re.sub(r"[ \t]+", " ", text)
    if len(text) < min_chars:
        raise BadInputError(f"the Python documentation has {len(text)} characters, fewer than {min_chars}")
    return Text(text=text, source="Python documentation (pydoc_data.topics, shipped with CPython)")


@dataclass(frozen=True)
class DocTopic:
    """One topic of Python's documentation: its key, its title line and its prose (title excluded)."""

    key: str
    title: str
    prose: str


def python_doc_topics(min_chars: int = 0) -> list[DocTopic]:
    """The documentation topics with at least ``min_chars`` characters of prose, sorted by key."""
    import pydoc_data.topics as topics

    out = []
    for key in sorted(topics.topics):
        lines = _prose_lines(topics.topics[key])
        if len(lines) < 2:
            continue
        prose = re.sub(r"[ \t]+", " ", " ".join(lines[1:]))
        if len(prose) >= min_chars:
            out.append(DocTopic(key=key, title=lines[0], prose=prose))
    return out


#: The largest text file kvlab reads: 64 MiB (about 16 million tokens, far more than any command uses).
#: ``KVLAB_MAX_TEXT_BYTES`` sets another limit (a number of bytes).
MAX_TEXT_BYTES = 64 * 2**20


def max_text_bytes() -> int:
    """The text-file limit in bytes: ``$KVLAB_MAX_TEXT_BYTES`` when set, else :data:`MAX_TEXT_BYTES`."""
    env = os.environ.get("KVLAB_MAX_TEXT_BYTES", "").strip()
    if not env:
        return MAX_TEXT_BYTES
    try:
        limit = int(env)
    except ValueError:
        raise BadInputError(f"KVLAB_MAX_TEXT_BYTES must be a number of bytes, got {env!r}") from None
    if limit < 1:
        raise BadInputError(f"KVLAB_MAX_TEXT_BYTES must be >= 1, got {limit}")
    return limit


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def read_file_bytes(path: str | Path, *, limit: int | None = None, what: str = "text file") -> bytes:
    """The bytes of a file a user named, read with a size limit; one BadInputError line otherwise.

    Refused before reading anything: a missing path, a folder, and anything that is not a regular file
    (a FIFO would block the read, ``/dev/zero`` never ends); a file over ``limit`` bytes (default
    :func:`max_text_bytes`; a 12 GB file is refused from its size, not read). The file is opened
    non-blocking and checked again once open, so a path swapped for a FIFO meanwhile cannot hang, and
    at most ``limit + 1`` bytes are ever read (a file that grows past the limit is refused too).
    """
    path = Path(path)
    hint = " (KVLAB_MAX_TEXT_BYTES sets another)" if limit is None else ""
    limit = max_text_bytes() if limit is None else limit
    _refuse_pseudo_file(path, what)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise BadInputError(f"{path} is not a file (nothing is there)") from None
    except OSError as exc:
        raise BadInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    _check_regular(path, info, limit, what, hint)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        _check_regular(path, os.fstat(fd), limit, what, hint)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise BadInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise BadInputError(f"{path} grew past the {_size(limit)} limit for a {what} while it was read")
    return b"".join(chunks)


#: Kernel pseudo-filesystems: their files look regular and empty to stat, yet hold live process state
#: (``/proc/self/environ`` has the environment, API keys included), so no report may quote them.
PSEUDO_ROOTS = (Path("/proc"), Path("/sys"))


def _refuse_pseudo_file(path: Path, what: str) -> None:
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise BadInputError(f"cannot read {path}: {exc}") from None
    if any(real == root or root in real.parents for root in PSEUDO_ROOTS):
        raise BadInputError(f"{path} is a kernel pseudo-file ({real}), not a {what}")


def _check_regular(path: Path, info: os.stat_result, limit: int, what: str, hint: str = "") -> None:
    if stat.S_ISDIR(info.st_mode):
        raise BadInputError(f"{path} is not a file (it is a folder); give a {what}")
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a device"
            if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
            else "a socket"
            if stat.S_ISSOCK(info.st_mode)
            else "something other than a regular file"
        )
        raise BadInputError(f"{path} is not a file (it is {kind}); give a {what}")
    if info.st_size > limit:
        raise BadInputError(
            f"{path} is {_size(info.st_size)}, over the {_size(limit)} limit for a {what}{hint}"
        )


def read_user_text(path: str | Path, *, limit: int | None = None, what: str = "text file") -> str:
    """A user's UTF-8 file as text, read through :func:`read_file_bytes` (regular file, size limit):
    one BadInputError line for anything else, including bytes that are not UTF-8 and a file holding
    only whitespace."""
    data = read_file_bytes(path, limit=limit, what=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise BadInputError(f"{path} is empty")
    return text


def read_text_file(path: str | Path) -> Text:
    """A text file for an experiment (``--text``, a sweep's ``texts``, ``kvlab store put -T``): read by
    :func:`read_user_text` (a regular UTF-8 file under the size limit); a Project Gutenberg book keeps
    only its body."""
    path = Path(path)
    text = read_user_text(path)
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
