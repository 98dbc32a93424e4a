"""Compaction (R11 + B5): building the conditions exactly, a smoke run on a small conversations file, and
the conversations a fresh clone makes with its own model (format, determinism, the cache, a full run)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import BadInputError
from kvlab.metrics.similarity import centroid_cosine
from kvlab.model.handle import ModelHandle
from kvlab.study.experiments import _conversations as built
from kvlab.study.experiments import compaction as comp
from kvlab.study.experiments import get_experiment
from kvlab.study.experiments.base import ExperimentContext
from kvlab.study.runner import run_experiment

TOPICS = (
    (
        "bread",
        "How do I bake sourdough bread at home?",
        "Feed a starter for a week, then mix flour, water and salt.",
        "Why did my loaf come out flat and dense?",
        "Flat loaves usually mean an underfed starter or overproofed dough; shape tighter and bake hotter.",
    ),
    (
        "sailing",
        "What should I pack for a day of sailing?",
        "Bring a windproof jacket, water, sun cream and gloves.",
        "How do I know when the wind is too strong to go out?",
        "Above roughly twenty knots small dinghies struggle; check the forecast for gusts and reef early.",
    ),
    (
        "chess",
        "How can I get better at chess endgames?",
        "Study king and pawn endings first, then rook endings.",
        "Which rook ending should I learn first?",
        "Learn the Lucena position to win and the Philidor position to draw; most rook endings reduce to them.",
    ),
)


def _conversation(topic: str, q: str, a: str, q2: str, a2: str) -> dict:
    turns = [
        ("User", q),
        ("Assistant", a),
        ("User", f"Tell me more about {topic}, step by step."),
        (
            "Assistant",
            f"Sure. The first step with {topic} is patience, the second is practice, and the third "
            f"is keeping notes on what worked.",
        ),
        ("User", q2),
        ("Assistant", a2),
    ]
    full = "\n\n".join(f"{r}: {t}" for r, t in turns)
    summary = f"## Goal\nLearn about {topic}.\n\n## Progress\n- Covered the basics and a step-by-step plan."
    recent = "\n\n".join(f"{r}: {t}" for r, t in turns[-2:])
    compacted = (
        f"[Context from compacted conversation history]\n\n{summary}\n\n[Recent conversation]\n\n{recent}"
    )
    return {"full": full, "compacted": compacted, "summary": summary}


@pytest.fixture(scope="module")
def conversations():
    return [_conversation(*t) for t in TOPICS]


def test_parse_turns():
    msgs = comp.parse_turns("Intro line\n\nUser: hi there\n\nAssistant: hello\nsecond line\n\nUser: bye")
    assert msgs == [
        {"role": "user", "content": "Intro line"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello\nsecond line"},
        {"role": "user", "content": "bye"},
    ]


def test_conditions_decompose_exactly(smollm, conversations):
    """compacted = summary only + verbatim tail, token for token; the tail is the full chat's ending."""
    msgs = comp.conversation_messages(conversations[0], conversations[1], seed=0)
    ids = {k: comp.chat_ids(smollm, m) for k, m in msgs.items()}
    assert ids["compacted"][: len(ids["summary_only"])] == ids["summary_only"]
    tail = comp.common_suffix(ids["full"], ids["compacted"])
    assert tail >= len(ids["compacted"]) - len(ids["summary_only"])  # everything after the summary is shared
    assert comp.common_suffix(ids["full"], ids["verbatim_tail_only"]) >= len(ids["compacted"]) - len(
        ids["summary_only"]
    )
    assert sorted(msgs["shuffled_compacted"][0]["content"].split()) == sorted(
        conversations[0]["compacted"].split()
    )
    assert msgs["unrelated"] == comp.parse_turns(conversations[1]["full"])


def test_thread_numbers_come_from_the_shipped_reference():
    assert comp.thread_centroid_v() == {"compacted": 0.85, "unrelated": 0.58}


def test_common_suffix():
    assert comp.common_suffix([1, 2, 3], [9, 2, 3]) == 2
    assert comp.common_suffix([1, 2, 3], [1, 2, 3]) == 3
    assert comp.common_suffix([], [1]) == 0


def test_centroids_match_the_similarity_module(tiny_model):
    h = tiny_model("llama")
    a = h.prefill(list(range(3, 20))).snapshot
    b = h.prefill(list(range(40, 51)), start_position=7).snapshot
    ca, cb = comp.cache_centroids(a), comp.cache_centroids(b)
    np.testing.assert_allclose(comp.centroid_cos(ca[0], cb[0]), centroid_cosine(a, b, "k"), atol=1e-12)
    np.testing.assert_allclose(comp.centroid_cos(ca[1], cb[1]), centroid_cosine(a, b, "v"), atol=1e-12)
    np.testing.assert_allclose(comp.centroid_cos(ca, ca), 1.0, atol=1e-12)
    centred = comp.centroid_cos(ca, ca, center=ca)  # a vector minus itself has no direction
    assert np.isnan(centred).all()


def test_bad_input(tmp_path, conversations):
    ctx = ExperimentContext(out_dir=tmp_path)
    with pytest.raises(BadInputError, match="at least 3"):
        comp.run(ctx, conversations=conversations[:2])
    bad = tmp_path / "bad.json"
    bad.write_text('{"full": "x"}')
    with pytest.raises(BadInputError, match="JSON list"):
        comp.run(ctx, conversations=bad)
    with pytest.raises(BadInputError, match="non-empty 'compacted'"):
        comp.conversation_messages({"full": "User: hi"}, conversations[0])


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model):
    """A tiny random SmolLM2-family model with a byte-level tokenizer and a ChatML template: it writes
    nonsense, but through exactly the code path the bundled model takes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    tok.chat_template = CHATML
    tiny = tiny_model("smollm2", vocab=len(tok), seed=3)
    return ModelHandle(tiny.model, tok, name="tiny-chat")


@pytest.fixture(scope="module", autouse=True)
def short_conversations():
    """Short passages and 8-token replies in this module: the same code path, a fraction of the work
    (the test tokenizer spends a token on every byte)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(built, "EXCERPT_CHARS", 120)
        mp.setattr(built, "REPLY_TOKENS", 8)
        mp.setattr(built, "SUMMARY_TOKENS", 8)
        yield


@pytest.fixture(scope="module")
def built_cache(chat_model, tmp_path_factory):
    """A cache folder holding the first 3 conversations ``chat_model`` makes (built once per module)."""
    folder = tmp_path_factory.mktemp("kvlab-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLAB_CACHE_DIR", str(folder))
        convs = built.model_conversations(chat_model, 3)
    return folder, convs


def test_built_conversations_have_the_compaction_format(chat_model, built_cache):
    convs = built_cache[1]
    for conv, topic in zip(convs, built.topics()[:3], strict=True):
        assert conv["topic"] == topic.key
        full = comp.parse_turns(conv["full"])
        assert [m["role"] for m in full] == ["user", "assistant"] * 3
        assert topic.title in full[0]["content"] and topic.prose[:100] in full[0]["content"]
        assert full[4]["content"] == built.FOLLOW_UP
        assert all(m["content"] for m in full)
        header, recent = conv["compacted"].split(built.RECENT_MARKER)
        assert comp.parse_turns(recent.strip()) == full[-2:]  # the last exchange, verbatim
        assert header.strip() == f"{built.SUMMARY_LABEL}\n{conv['summary']}"
    # compacted = summary only + the verbatim tail, token for token, and that tail ends the full chat
    msgs = comp.conversation_messages(convs[0], convs[1])
    ids = {k: comp.chat_ids(chat_model, m) for k, m in msgs.items()}
    assert ids["compacted"][: len(ids["summary_only"])] == ids["summary_only"]
    rest = len(ids["compacted"]) - len(ids["summary_only"])
    assert comp.common_suffix(ids["full"], ids["compacted"]) >= rest > 0


def test_built_conversations_are_deterministic_and_cached_per_model(
    chat_model, built_cache, tmp_path, monkeypatch
):
    folder, first = built_cache
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "a"))
    built.cache_path(chat_model).parent.mkdir(parents=True)
    path = built.cache_path(chat_model)
    path.write_bytes((folder / path.relative_to(tmp_path / "a")).read_bytes())  # a copy to tamper with
    real_build = built.build_conversation

    def no_build(*_):
        raise AssertionError("a cached conversation was built again")

    monkeypatch.setattr(built, "build_conversation", no_build)
    assert built.model_conversations(chat_model, 3) == first
    assert built.model_conversations(chat_model, 2, order=[2, 0, 1]) == [first[2], first[0]]
    # another model's (or version's) file under this name is not read as this model's
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "fingerprint": "another model"}))
    with pytest.raises(AssertionError, match="built again"):
        built.model_conversations(chat_model, 1)
    # greedy: an empty cache folder builds the very same conversation again
    monkeypatch.setattr(built, "build_conversation", real_build)
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "b"))
    assert built.model_conversations(chat_model, 1) == first[:1]
    assert built.cache_path(chat_model).is_file()
    with pytest.raises(BadInputError, match="conversations"):
        built.model_conversations(chat_model, len(built.topics()) + 1)


@pytest.mark.slow
def test_fresh_clone_runs_on_conversations_the_model_makes(chat_model, built_cache, tmp_path, monkeypatch):
    """No ../shared: the quick profile compares 3 conversations the model made (read back from the
    cache here), and says so."""
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(built_cache[0]))
    monkeypatch.setattr(comp, "shared_conversations", lambda: None)
    ctx = ExperimentContext(out_dir=tmp_path / "run", profile="quick", model_handle=chat_model)
    result = comp.run(ctx)
    assert result.status == "ok" and result.summary["conversations"] == 3
    assert result.data_sources[0].startswith(
        "conversations made by tiny-chat from Python's documentation"
    ) and result.data_sources[0].endswith(": 3 conversations, chat template of tiny-chat")
    assert any("the 3 conversations were made by tiny-chat" in n for n in result.notes)
    assert result.arrays["centroids"].shape[:2] == (3, len(comp.CONDITIONS))
    with pytest.raises(BadInputError, match="at least 3"):
        comp.run(ExperimentContext(out_dir=tmp_path / "two", model_handle=chat_model), limit=2)


@pytest.mark.slow
def test_compaction_smoke_run(smollm, tmp_path, conversations):
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(conversations))
    ctx = ExperimentContext(
        out_dir=tmp_path / "compaction", profile="quick", model_handle=smollm, options={"conversations": path}
    )
    result = run_experiment(get_experiment("compaction"), ctx)
    doc = json.loads((tmp_path / "compaction" / "result.json").read_text())
    assert doc["status"] == "ok"
    for fig in result.figures:
        assert (tmp_path / "compaction" / fig.filename).stat().st_size > 1000
    arrays = np.load(tmp_path / "compaction" / "arrays.npz")
    L, H, D = smollm.facts.num_layers, smollm.facts.num_kv_heads, smollm.facts.head_dim
    assert arrays["centroids"].shape == (3, len(comp.CONDITIONS), 2, L, H, D)
    tail = result.summary["tail"]
    # The same tokens at the end (compacted) are far more alike slot by slot than another conversation's.
    assert tail["compacted"]["cos_v"]["value"] > tail["unrelated"]["cos_v"]["value"] + 0.2
    assert "Confound" in " ".join(result.notes)
    # the compacted cache against each other condition, conversation by conversation
    paired, cent = result.summary["centroid_paired"], result.summary["centroid"]
    assert set(paired) == set(comp.CONDITIONS) - {"compacted"}
    want = cent["compacted"]["v_centred"]["value"] - cent["verbatim_tail_only"]["v_centred"]["value"]
    assert paired["verbatim_tail_only"]["v_centred"]["value"] == pytest.approx(want, abs=1e-9)
    assert paired["unrelated"]["v"]["n"] == 3 and paired["unrelated"]["v"]["low"] is None  # 3: no interval
    table = next(t for t in result.tables if t.title.startswith("Compacted minus each other condition"))
    assert all(cell.endswith("(n = 3, no interval)") for row in table.rows for cell in row[1:])
