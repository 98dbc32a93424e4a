"""Compaction (R11 + B5): building the conditions exactly, and a smoke run on a small conversations file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import BadInputError
from kvlab.metrics.similarity import centroid_cosine
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


def test_not_applicable_without_conversations(tmp_path, monkeypatch):
    monkeypatch.setattr(comp, "shared_conversations", lambda: None)
    result = comp.run(ExperimentContext(out_dir=tmp_path))
    assert result.status == "not_applicable"
    assert "--conversations" in result.notes[0]


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
