"""The shared-data code (``../shared/data``: Gutenberg books, UltraChat conversations), on the small copy in
tests/fixtures/shared-data; and the rest of the suite never reads ``../shared`` (a fresh clone runs the same)."""

from __future__ import annotations

from pathlib import Path

from kvlab.data import default_long_text, python_docs, shared_book, shared_conversations
from kvlab.paths import shared_data_dir
from kvlab.study.experiments import compaction as comp


def test_suite_does_not_read_shared_data_even_when_beside_the_checkout(monkeypatch, tmp_path):
    assert shared_data_dir() is None  # conftest sets KVLAB_SHARED_DATA=none
    assert shared_book("frankenstein") is None and shared_conversations() is None
    assert default_long_text().source == python_docs().source
    # "none" wins over a ../shared/data beside the working directory (the fallback candidate)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")
    assert shared_data_dir() is None
    monkeypatch.delenv("KVLAB_SHARED_DATA")
    assert shared_data_dir() is not None  # without it, ../shared/data is found (the study's default)


def test_shared_book_keeps_the_body_between_the_gutenberg_markers(shared_data):
    assert shared_data_dir() == shared_data
    book = shared_book("frankenstein")
    assert book is not None and book.source == "frankenstein.txt"
    raw = (shared_data / "texts" / "frankenstein.txt").read_text(encoding="utf-8")
    assert "Project Gutenberg" in raw[:200] and "Project Gutenberg" not in book.text
    assert book.text.startswith("Frankenstein;") and "START OF" not in book.text and "END OF" not in book.text
    assert "You will rejoice to hear" in book.text  # Letter 1
    assert default_long_text().source == "frankenstein.txt"
    assert shared_book("no_such_book") is None


def test_shared_conversations_parse_into_chat_messages(shared_data):
    convs = shared_conversations()
    assert convs is not None and len(convs) == 3
    for i, conv in enumerate(convs):
        msgs = comp.conversation_messages(conv, convs[(i + 1) % len(convs)])
        assert msgs["full"] and msgs["compacted"]
        assert {m["role"] for m in msgs["full"]} >= {"user", "assistant"}
    assert comp.load_conversations(Path(shared_data) / "ultrachat_compaction.json") == convs
