"""Compacted conversations the model makes from Python's documentation: the compaction study's data
on a machine without ``../shared`` (where the UltraChat set lives).

Each conversation is about one documentation topic (:func:`kvlab.data.python_doc_topics`). The user
quotes a passage and asks what it says, quotes the next passage and asks what it adds, then asks for
an example; the model answers each turn greedily through its own chat template. The compacted
version is what a compacting assistant keeps: a summary of the first two exchanges, written by the
same model (greedy, asked to summarise them), then the last exchange verbatim, in the
``{'full', 'compacted', 'summary'}`` format :mod:`kvlab.study.experiments.compaction` reads.

A conversation is a deterministic function of the model's weights, the topic and :data:`VERSION`,
so each is built once per model and kept in kvlab's cache folder
(``cache_dir()/conversations/compaction-v<VERSION>-<fingerprint>.json``, keyed by topic); later runs,
and other seeds that draw the same topics, read it back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.data import DocTopic, python_doc_topics
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.model.handle import ModelHandle
from kvlab.paths import cache_dir

#: Bump when the prompts, lengths or format change: the cached conversations are rebuilt.
VERSION = 1
RECENT_MARKER = "[Recent conversation]"
SUMMARY_LABEL = "Summary of the earlier conversation:"
MIN_TOPIC_CHARS = 1200
EXCERPT_CHARS = 500
REPLY_TOKENS = 48
SUMMARY_TOKENS = 64
FOLLOW_UP = "Give me one short example of when I would use this."
SUMMARY_REQUEST = "Summarise our conversation so far in two or three sentences."


def source(handle: ModelHandle) -> str:
    """Where the built conversations come from, for the report."""
    return (
        f"conversations made by {handle.name} from Python's documentation (pydoc_data.topics, one topic "
        "each; its own greedy replies and summaries)"
    )


def chat_ids(model: ModelHandle, messages: list[dict], *, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the model's chat template."""
    if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
        raise UnsupportedModelError("the compaction study needs a tokenizer with a chat template")
    if not messages:
        return []
    ids: Any = model.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def topics() -> list[DocTopic]:
    """The topics conversations are made from, in their listed order (seed 0 takes the first)."""
    return python_doc_topics(MIN_TOPIC_CHARS)


def _excerpts(prose: str) -> tuple[str, str]:
    """The topic's first two passages of whole sentences, each at least :data:`EXCERPT_CHARS` long."""
    sentences = re.split(r"(?<=[.!?:])\s+", prose.strip())
    chunks: list[str] = []
    current: list[str] = []
    for s in sentences:
        current.append(s)
        if sum(len(x) + 1 for x in current) >= EXCERPT_CHARS:
            chunks.append(" ".join(current))
            current = []
            if len(chunks) == 2:
                break
    if current and len(chunks) < 2:
        chunks.append(" ".join(current))
    if len(chunks) < 2:
        raise BadInputError("a documentation topic needs two passages of prose")
    return chunks[0], chunks[1]


def _reply(handle: ModelHandle, messages: list[dict], max_tokens: int) -> str:
    """The model's greedy reply to ``messages``, on one line per paragraph (a blank line would read as
    a turn boundary in the ``User: / Assistant:`` text)."""
    ids = chat_ids(handle, messages, add_generation_prompt=True)  # refuses a model without a template
    out = handle.prefill(ids, all_logits=False)
    gen = handle.generate(out.snapshot, out.logits[-1], max_tokens)
    eos = handle.eos_ids()
    tokens = [t for t in gen.token_ids if t not in eos]
    text = handle.tokenizer.decode(tokens, skip_special_tokens=True) if handle.tokenizer else ""
    return re.sub(r"\n\s*\n", "\n", text).strip() or "(no reply)"


def build_conversation(handle: ModelHandle, topic: DocTopic) -> dict[str, Any]:
    """One conversation about ``topic``, its compacted version and its summary (all greedy)."""
    first, second = _excerpts(topic.prose)
    questions = (
        f'Here is a passage from Python\'s documentation on "{topic.title}":\n\n{first}\n\n'
        "What does it say, in plain words?",
        f"The documentation goes on:\n\n{second}\n\nWhat does this add?",
        FOLLOW_UP,
    )
    messages: list[dict] = []
    summary = ""
    for i, question in enumerate(questions):
        if i == len(questions) - 1:  # the history the compaction replaces: summarised before the last turn
            ask = [*messages, {"role": "user", "content": SUMMARY_REQUEST}]
            summary = _reply(handle, ask, SUMMARY_TOKENS)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": _reply(handle, messages, REPLY_TOKENS)})

    def turns(ms: list[dict]) -> str:
        return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in ms)

    return {
        "topic": topic.key,
        "full": turns(messages),
        "compacted": f"{SUMMARY_LABEL}\n{summary}\n\n{RECENT_MARKER}\n\n{turns(messages[-2:])}",
        "summary": summary,
    }


def cache_path(handle: ModelHandle) -> Path:
    """Where this model's conversations are kept (keyed by its fingerprint and :data:`VERSION`)."""
    return cache_dir() / "conversations" / f"compaction-v{VERSION}-{handle.fingerprint[:20]}.json"


def _read_cache(path: Path, fingerprint: str) -> dict[str, dict]:
    """The cached conversations by topic; empty when the file is absent, unreadable or not this model's."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or doc.get("fingerprint") != fingerprint:
        return {}
    convs = doc.get("conversations")
    if not isinstance(convs, dict):
        return {}
    return {
        k: c
        for k, c in convs.items()
        if isinstance(c, dict) and all(isinstance(c.get(f), str) and c[f] for f in ("full", "compacted"))
    }


def _write_cache(path: Path, handle: ModelHandle, convs: dict[str, dict]) -> None:
    """Write atomically (a temp file renamed into place), so a concurrent reader sees old or new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "version": VERSION,
        "model": handle.name,
        "fingerprint": handle.fingerprint,
        "conversations": convs,
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)


def model_conversations(
    handle: ModelHandle,
    count: int,
    order: list[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """``count`` conversations about the topics ``order`` picks (default: as listed), built by
    ``handle`` where its cache lacks them; ``progress(1)`` after each one built."""
    pool = topics()
    order = list(range(len(pool))) if order is None else order
    if not 1 <= count <= len(pool):
        raise BadInputError(f"Python's documentation gives 1..{len(pool)} conversations, asked for {count}")
    chosen = [pool[i] for i in order[:count]]
    path = cache_path(handle)
    cached = _read_cache(path, handle.fingerprint)
    missing = [t for t in chosen if t.key not in cached]
    for topic in missing:
        cached[topic.key] = build_conversation(handle, topic)
        if progress is not None:
            progress(1)
    if missing:
        _write_cache(path, handle, cached)
    return [cached[t.key] for t in chosen]
