"""The thread's numbers as kvlab ships them (kvlab/study/data/thread_reference.json): present in a fresh
clone, packaged with the wheel, consistent with themselves and with the research brief's summary, and
what the findings and attention sections put beside their own numbers."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import numpy as np

from kvlab.study.experiments import _rolling as R
from kvlab.study.experiments import attention, findings

REPO = Path(__file__).resolve().parents[1]
CONDITIONS = (
    "roll_1",
    "roll_2",
    "roll_3",
    "roll_5",
    "roll_10",
    "roll_20",
    "scrambled",
    "unrelated",
    "truncated",
)


def test_the_reference_ships_inside_the_package():
    ref = R.reference()
    assert ref.root == R.REFERENCE_FILE and (REPO / "src" / "kvlab") in ref.root.parents
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "kvlab"
    ]
    rel = ref.root.relative_to(REPO / "src" / "kvlab").as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in the wheel's package-data"


def test_every_file_the_experiments_read_is_there_and_whole():
    ref = R.reference()
    for name, layers in (("orig_14b_base_results", 48), ("orig_7b_base_results", 28)):
        d = ref.get(name)
        assert set(d) == set(CONDITIONS)
        for cond in CONDITIONS:
            for m in ("cos_k", "cos_v"):
                entry = d[cond][m]
                assert len(entry["per_layer"]) == layers
                # the mean over layers, heads and positions is the mean of the per-layer means
                assert abs(np.mean(entry["per_layer"]) - entry["mean"]) < 1e-5, (name, cond, m)
        # the truncated condition drops the last token of the 87-token prompt: 86 positions
        assert len(d["truncated"]["cos_k"]["per_position"]) == 86
    for name, keys in (
        ("results_14b_base_roll_truncate", ("roll_last_k", "trunc_last_k")),
        (
            "results_rope_2000_roll_truncate_rope",
            ("roll_last_k_raw", "trunc_last_k_raw", "roll_last_k_derot"),
        ),
    ):
        d = ref.get(name)
        assert d["seq_len"] == 2000 and np.all(np.diff(d["ns"]) == 5)
        assert all(len(d[k]) == len(d["ns"]) for k in keys)
    # one run behind both roll-truncate files: the raw curves agree to the last digit
    a, b = ref.get("results_14b_base_roll_truncate"), ref.get("results_rope_2000_roll_truncate_rope")
    assert a["roll_last_k"] == b["roll_last_k_raw"] and a["trunc_last_k"] == b["trunc_last_k_raw"]
    att = attention.load_reference()
    assert att["rolls"] == [1, 2, 3, 5, 10, 20]
    assert all(att["attention"][n]["cosine_sim"].shape == (48,) for n in att["rolls"])
    assert "thread_reference.json" in att["source"]


def test_the_files_match_the_research_briefs_summary():
    """The brief's section 3 table and roll-truncate offset, rounded there, from the shipped numbers."""
    d = R.reference().get("orig_14b_base_results")
    brief = {"roll_1": (0.972, 0.973), "roll_5": (0.889, 0.931), "roll_20": (0.825, 0.903)}
    brief |= {"scrambled": (0.664, 0.099), "unrelated": (0.633, 0.067), "truncated": (1.0, 1.0)}
    for cond, (k, v) in brief.items():
        assert abs(d[cond]["cos_k"]["mean"] - k) <= 1e-3 and abs(d[cond]["cos_v"]["mean"] - v) <= 1e-3, cond
    rt = R.reference().get("results_14b_base_roll_truncate")
    offset = np.asarray(rt["roll_last_k"]) - np.asarray(rt["trunc_last_k"])
    assert abs(offset.mean() - 0.19) < 0.01


def _iv(value: float, half: float = 0.01) -> dict:
    return {"value": value, "low": value - half, "high": value + half, "n": 20}


def test_findings_put_the_shipped_numbers_beside_kvlabs():
    ref = R.reference()
    sweep = {
        "windows": 20,
        "context_tokens": 128,
        "conditions": {
            c: {"k_x0": _iv(k), "v_x0": _iv(v)}
            for c, k, v in (("unrelated", 0.79, 0.18), ("scrambled", 0.82, 0.25), ("roll_20", 0.9, 0.94))
        },
        "control_order_paired": {
            "scrambled-unrelated": {"k": _iv(0.03), "v": _iv(0.07)},
            "roll_20-scrambled": {"k": _iv(0.08), "v": _iv(0.69)},
        },
    }
    (order,) = findings._claim_order(sweep, ref.get("orig_14b_base_results"))
    assert order["thread"] == "K 0.632 < 0.664 < 0.825" and order["verdict"] == "holds"
    assert "paired s − u +0.03 [+0.02, +0.04] (n = 20)" in order["measured"]
    attn = {
        "with_sink": np.full((6, 3, 30), 0.6),
        "without_sink": np.full((6, 3, 30), 0.97),
        "tokens": np.asarray(64),
    }
    (row,) = findings._claim_attention(attn, ref)
    assert row["thread"].startswith(
        "≈0.41 at every roll (research brief); reference file: layer-mean cosine "
    )
    assert row["verdict"] == "artefact"
    # without the shipped file there is no thread number, and nothing made up in its place
    (bare,) = findings._claim_order(sweep, R.Reference(None).get("orig_14b_base_results"))
    assert bare["thread"] == "—"


def test_control_order_is_decided_by_paired_differences():
    """unrelated < scrambled < roll 20 holds when every paired step's interval lies above 0, even where the
    conditions' own intervals overlap; a step that reaches 0 fails it; fewer than 5 text samples cannot
    decide; a roll_sweep result without the paired differences leaves it untested."""
    from kvlab.study.experiments import roll_sweep

    rng = np.random.default_rng(0)
    base = rng.uniform(0.3, 0.9, size=20)  # per text sample: wide spread, small consistent steps
    raw = {
        c: {m: [np.full((2, 2, 4), b + step) for b in base] for m in ("k", "v")}
        for c, step in (("unrelated", 0.0), ("scrambled", 0.01), ("roll_20", 0.02))
    }
    summ = roll_sweep.summarise(raw)
    sweep = {"windows": 20, "context_tokens": 64, "conditions": summ}
    sweep["control_order_paired"] = roll_sweep.paired_order(raw)
    u, s = summ["unrelated"]["k_x0"], summ["scrambled"]["k_x0"]
    assert u["high"] > s["low"]  # the unpaired intervals overlap
    (order,) = findings._claim_order(sweep, None)
    assert order["verdict"] == order["outcome"] == "holds", order["measured"]
    assert abs(order["key"]["value"] - 0.01) < 1e-9
    raw["roll_20"]["v"] = raw["scrambled"]["v"]  # no step from scrambled to roll 20 in V
    sweep["control_order_paired"] = roll_sweep.paired_order(raw)
    assert findings._claim_order(sweep, None)[0]["verdict"] == "does not hold"
    few = {c: {m: a[:3] for m, a in ms.items()} for c, ms in raw.items()}
    (undecided,) = findings._claim_order(
        {**sweep, "control_order_paired": roll_sweep.paired_order(few)}, None
    )
    assert undecided["verdict"] == undecided["outcome"] == "cannot decide"
    assert "(n = 3, no interval)" in undecided["measured"]
    del sweep["control_order_paired"]
    assert findings._claim_order(sweep, None)[0]["outcome"] == "not tested here"
