"""The ``ruler`` study experiment: tables, figures, raw arrays and verdicts on a tiny random model; the
claims' rules on hand-made rows (each can come out false); a bundled-model smoke."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.eval.specs import parse_cache_specs
from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.experiments import ruler as R
from kvlab.study.runner import run_experiment
from tests.test_eval_tasks import WordTokenizer

SMALL = {
    "tasks": ["niah_single", "vt"],
    "lengths": [160],
    "trials": 2,
    "policies": ["h2o", "snapkv", "window"],
    "ratios": [0.25, 0.5],
    "codecs": ["int4", "kivi2"],
    "max_new_tokens": 3,
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


def _check_interval(iv, lo=0.0, hi=1.0):
    assert iv is not None and lo <= iv["value"] <= hi
    assert iv["low"] is None or iv["low"] <= iv["value"] <= iv["high"]


def test_the_experiment_on_a_tiny_model(tiny, tmp_path):
    ctx = ExperimentContext(out_dir=tmp_path / "ruler", profile="quick", options=SMALL)
    ctx.model_handle = tiny
    result = run_experiment(get_experiment("ruler"), ctx)
    assert result.status == "ok", result.notes
    s = result.summary
    caches = s["settings"]["caches"]
    assert caches == [
        "full", "h2o:0.25", "h2o:0.5", "snapkv:0.25", "snapkv:0.5", "window:0.25", "window:0.5", "int4", "kivi2"
    ]  # fmt: skip
    # a table of verdicts, one per task, one pooled; every cache at the length in each task's table
    assert [t.title for t in result.tables] == [
        "Claims checked",
        "Each cache minus the full cache (accuracy, paired per trial, all tasks pooled)",
        "Task niah_single",
        "Task vt",
        "All tasks pooled",
    ]
    assert all(len(t.rows) == len(caches) for t in result.tables[2:])
    diffs = result.tables[1].rows  # every other cache against the full one, on the same 4 trials
    assert [r[1] for r in diffs] == caches[1:] and all(r[2] == 4 and r[4] == "cannot decide" for r in diffs)
    assert all(r[3].endswith("(n = 4, no interval)") for r in diffs)
    for p in s["points"]:
        assert p["trials"] == (4 if p["task"] == "all" else 2)
        _check_interval(p["accuracy"])
        _check_interval(p["top1"])
        _check_interval(p["kld"], 0.0, np.inf)
        assert p["bytes_per_token"] > 0 and 0 < p["kept_fraction"] <= 1
        if p["cache"] == "full":
            assert p["kld"]["value"] == 0 and p["top1"]["value"] == 1 and p["kept_fraction"] == 1
        else:
            assert p["kld"]["value"] > 0
    by = {(p["task"], p["cache"]): p for p in s["points"]}
    assert by["all", "h2o:0.5"]["bytes_per_token"] < by["all", "h2o:0.25"]["bytes_per_token"]
    assert by["all", "int4"]["bytes_per_token"] < by["all", "full"]["bytes_per_token"]
    # verdicts: every claim has a verdict from the three outcomes, a measured line and a rule
    assert set(s["verdicts"]) == {"h2o_best_accuracy", "h2o_best_kl", "int4_free", "monotone"}
    for c in s[
        "claims"
    ]:  # 4 trials (2 per task): too few for a paired interval, the comparisons cannot decide
        assert c["verdict"] in ("cannot decide", "does not hold") and c["measured"] and c["rule"]
    kl_claim = next(c for c in s["claims"] if c["id"] == "h2o_best_kl")
    assert set(kl_claim["by_policy"]) == {"h2o", "snapkv", "streaming_llm"}
    assert kl_claim["verdict"] == "cannot decide" and kl_claim["difference"]["n"] == 4
    assert kl_claim["difference"]["low"] is None and "n = 4, no interval" in kl_claim["measured"]
    # files: two figures, the raw per-trial arrays, result.json
    out = tmp_path / "ruler"
    assert (out / "accuracy_vs_ratio.png").is_file() and (out / "kl_vs_bytes.png").is_file()
    arrays = np.load(out / "arrays.npz")
    n = 2 * 2 * len(caches)
    assert all(arrays[k].shape == (n,) for k in ("cache", "task", "score", "kld", "top1", "kv_bytes"))
    assert set(arrays["cache"]) == set(caches) and np.all((arrays["score"] >= 0) & (arrays["score"] <= 1))
    doc = json.loads((out / "result.json").read_text())
    assert doc["summary"]["verdicts"] == s["verdicts"] and doc["tables"]
    assert any(n.startswith("int4 costs almost nothing: ") for n in result.notes)


def _rows(values: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Hand-made rows: per cache, a list of (score, kld) per trial."""
    return [
        {"spec": spec, "score": sc, "kld": kl, "task": "t", "length": 100, "trial": i}
        for spec, vals in values.items()
        for i, (sc, kl) in enumerate(vals)
    ]


def test_h2o_claim_can_hold_and_fail():
    specs = parse_cache_specs(["full", "h2o:0.5", "snapkv:0.5", "h2o:0.25"])
    good, bad = [(1.0, 0.1)] * 10, [(0.0, 0.9)] * 10
    rows = _rows({"full": [(1.0, 0.0)] * 10, "h2o:0.5": good, "snapkv:0.5": bad, "h2o:0.25": bad})
    acc, kl = R.claim_h2o(rows, specs, 0, "score"), R.claim_h2o(rows, specs, 0, "kld")
    assert acc["verdict"] == kl["verdict"] == "holds"
    assert R.side(acc["difference"]) == "above 0" and R.side(kl["difference"]) == "below 0"
    assert acc["difference"]["value"] == 1.0 and "paired h2o − snapkv +1" in acc["measured"]
    rows = _rows({"full": [(1.0, 0.0)] * 10, "h2o:0.5": bad, "snapkv:0.5": good})
    acc = R.claim_h2o(rows, specs, 0, "score")
    assert acc["verdict"] == "does not hold" and acc["best"] == "snapkv" and acc["runner_up"] == "snapkv"
    assert R.side(acc["difference"]) == "below 0"
    mixed = [(1.0, 0.5), (0.0, 0.5)] * 5
    rows = _rows({"full": [(1.0, 0.0)] * 10, "h2o:0.5": mixed, "snapkv:0.5": mixed})
    tie = R.claim_h2o(rows, specs, 0, "score")
    assert tie["verdict"] == "does not hold" and R.side(tie["difference"]) == "contains 0"
    alone = R.claim_h2o(rows, parse_cache_specs(["full", "h2o:0.5"]), 0, "score")
    assert alone["verdict"] == "not tested here"


def test_int4_claim_can_hold_and_fail():
    specs = parse_cache_specs(["full", "int4"])
    full = [(1.0, 0.0), (0.0, 0.0)] * 10
    ok = R.claim_int4(_rows({"full": full, "int4": [(1.0, 0.002), (0.0, 0.004)] * 10}), specs, 0)
    assert ok["verdict"] == "holds" and ok["kl_ok"] and ok["accuracy_ok"]
    assert R.side(ok["accuracy_difference"]) == "contains 0" and ok["key"]["value"] == 0
    far = R.claim_int4(_rows({"full": full, "int4": [(1.0, 0.05), (0.0, 0.05)] * 10}), specs, 0)
    assert far["verdict"] == "does not hold" and not far["kl_ok"] and far["accuracy_ok"]
    wrong = R.claim_int4(_rows({"full": full, "int4": [(0.0, 0.001)] * 20}), specs, 0)
    assert wrong["verdict"] == "does not hold" and wrong["kl_ok"] and not wrong["accuracy_ok"]
    assert R.claim_int4(_rows({"full": full}), parse_cache_specs(["full"]), 0)["verdict"] == "not tested here"


def test_monotone_claim_can_hold_and_fail():
    specs = parse_cache_specs(["full", "h2o:0.25", "h2o:0.5", "snapkv:0.25", "snapkv:0.5"])
    s = {"tasks": ["t"], "lengths": [100], "policies": ["h2o", "snapkv"], "ratios": [0.25, 0.5]}
    falling = {"full": [(1.0, 0)] * 6, "h2o:0.25": [(0.75, 0.1)] * 6, "h2o:0.5": [(0.5, 0.2)] * 6}
    falling.update({"snapkv:0.25": [(1.0, 0.1)] * 6, "snapkv:0.5": [(0.25, 0.2)] * 6})
    rec = R.claim_monotone(_rows(falling), specs, s, 0)
    assert rec["verdict"] == "holds" and rec["steps"] == 4, rec["measured"]
    rising = {**falling, "snapkv:0.25": [(0.0, 0.1)] * 6}  # 1.0 -> 0.0 -> 0.25: rises at 0.5
    rec = R.claim_monotone(_rows(rising), specs, s, 0)
    assert rec["verdict"] == "does not hold" and rec["rising"] == ["snapkv 0.25→0.5 at 100"]
    assert rec["per_task_rising"] == ["snapkv 0.25→0.5 on t at 100"]
    # a rise on 2 of 6 trials and no change on the rest: the paired interval reaches 0, no rise seen
    noisy = {**falling, "h2o:0.5": [(1.0, 0.2)] * 2 + [(0.75, 0.2)] * 4}
    assert R.claim_monotone(_rows(noisy), specs, s, 0)["verdict"] == "holds"
    few = {k: v[:3] for k, v in rising.items()}  # 3 trials: no step has an interval
    rec = R.claim_monotone(_rows(few), specs, s, 0)
    assert rec["verdict"] == "cannot decide" and "4 have fewer than 5 trials (no interval)" in rec["measured"]


def test_paired_differences_see_what_overlapping_intervals_hide():
    """int4 loses 6 of 60 answers the full cache got and changes no other: the two accuracies' Wilson
    intervals overlap, the paired difference's interval lies below 0 (the issue's 1k case)."""
    specs = parse_cache_specs(["full", "int4"])
    full = [(1.0, 0.0)] * 30 + [(0.0, 0.0)] * 30
    int4 = [(0.0, 0.001)] * 6 + [(1.0, 0.001)] * 24 + [(0.0, 0.001)] * 30
    rec = R.claim_int4(_rows({"full": full, "int4": int4}), specs, 0)
    assert rec["accuracy"]["low"] < rec["full_accuracy"]["high"]  # the unpaired intervals overlap
    assert R.side(rec["accuracy_difference"]) == "below 0" and rec["accuracy_difference"]["n"] == 60
    assert rec["verdict"] == "does not hold" and rec["kl_ok"] and not rec["accuracy_ok"]
    assert "paired int4 − full accuracy -0.1 [" in rec["measured"] and "below 0" in rec["measured"]
    (row,) = R._paired_table(_rows({"full": full, "int4": int4}), specs, {"lengths": [100]}, 0).rows
    assert row[:3] == [100, "int4", 60] and row[3].startswith("-0.1 [") and row[4] == "below 0"


def test_bad_options_are_refused(tiny, tmp_path):
    from kvlab.errors import BadInputError

    ctx = ExperimentContext(out_dir=tmp_path / "r", profile="quick", options={"ratioz": [0.5]})
    ctx.model_handle = tiny
    with pytest.raises(BadInputError, match="unknown option"):
        run_experiment(get_experiment("ruler"), ctx)
    ctx.options = {**SMALL, "ratios": "0.5,1.5"}
    with pytest.raises(BadInputError, match=r"\[0, 1\)"):
        run_experiment(get_experiment("ruler"), ctx)


@pytest.mark.real_model
@pytest.mark.slow
def test_bundled_model_smoke(smollm, tmp_path):
    """SmolLM2-135M, one needle task at 160 tokens, 2 trials, h2o and snapkv at 0.5 and int4."""
    opts = {"tasks": ["niah_single"], "lengths": [160], "trials": 2, "max_new_tokens": 10}
    ctx = ExperimentContext(out_dir=tmp_path / "ruler", profile="quick", options=opts)
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("ruler"), ctx)
    assert result.status == "ok"
    assert result.summary["settings"]["caches"] == ["full", "h2o:0.5", "snapkv:0.5", "int4"]
    pts = {p["cache"]: p for p in result.summary["points"] if p["task"] == "all"}
    assert pts["int4"]["kld"]["value"] < pts["h2o:0.5"]["kld"]["value"]
    print("\n", *result.notes, sep="\n")


def test_claims_say_when_too_few_trials_leave_no_interval():
    specs = parse_cache_specs(["full", "h2o:0.5", "snapkv:0.5", "int4"])
    rows = _rows({"full": [(1.0, 0.0)] * 3, "h2o:0.5": [(1.0, 0.1)] * 3, "snapkv:0.5": [(0.0, 0.9)] * 3})
    h2o = R.claim_h2o(rows, specs, 0, "score")
    assert h2o["verdict"] == h2o["outcome"] == "cannot decide"
    assert h2o["measured"].endswith("paired h2o − snapkv +1 (n = 3, no interval)"), h2o["measured"]
    rows += _rows({"int4": [(1.0, 0.001)] * 3})
    int4 = R.claim_int4(rows, specs, 0)
    assert int4["verdict"] == "cannot decide" and "(n = 3, no interval)" in int4["measured"], int4["measured"]
    assert "[" not in int4["measured"] and "[" not in h2o["measured"]  # no interval printed from 3 trials
