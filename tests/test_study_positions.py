"""The ``positions`` study experiment: on a tiny random model, the three conventions on the same kept slots,
paired differences with intervals and verdicts that reach the report's claims table; the verdict rule on
hand-made differences (each outcome reachable); a bundled-model smoke."""

from __future__ import annotations

import pytest

from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.experiments import positions as P
from kvlab.study.runner import run_experiment
from tests.test_eval_tasks import WordTokenizer

SMALL = {
    "scores": ["h2o", "snapkv"],
    "ratios": [0.5, 0.75],
    "lengths": [160],
    "tasks": ["niah_single"],
    "trials": 5,
    "max_new_tokens": 3,
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


def test_the_experiment_on_a_tiny_model(tiny, tmp_path):
    from kvlab.study.report.html import quality_verdicts_data

    ctx = ExperimentContext(out_dir=tmp_path / "positions", profile="quick", options=SMALL)
    ctx.model_handle = tiny
    result = run_experiment(get_experiment("positions"), ctx)
    assert result.status == "ok", result.notes
    s = result.summary
    assert s["settings"]["caches"] == ["full", "h2o:0.5", "h2o:0.75", "snapkv:0.5", "snapkv:0.75"]
    assert [t.title for t in result.tables] == ["Claims checked", "Per score, ratio and length"]
    assert len(result.tables[1].rows) == 4
    for p in s["points"]:
        assert p["trials"] == 5 and p["original"]["kld"]["low"] is not None  # 5 trials: intervals
        for conv, _ in P.PAIRS:
            d = p[f"{conv}-original"]["kld"]
            want = p[conv]["kld"]["value"] - p["original"]["kld"]["value"]
            assert d["value"] == pytest.approx(want, abs=1e-9)  # the mean of the paired differences
    assert s["pooled"]["trials"] == 5  # a trial is the unit: its 4 evictions averaged
    assert set(s["verdicts"]) == {"positions_contiguous", "positions_cache"}
    assert all(
        v in ("original better", "contiguous better", "cache better", "no difference seen")
        for v in s["verdicts"].values()
    )
    table = quality_verdicts_data([("positions", result)], smoke=True)
    assert [c["evidence"][0][0] for c in table["claims"]] == ["#positions", "#positions"]


def test_the_verdict_follows_the_paired_interval():
    iv = {"value": 0.1, "low": 0.05, "high": 0.2, "n": 9}
    assert P.better(iv, False, "cache") == "original better"  # KL higher for cache: original better
    assert P.better(iv, True, "cache") == "cache better"  # accuracy higher for cache
    assert P.better({**iv, "low": -0.2, "high": -0.05}, False, "contiguous") == "contiguous better"
    assert P.better({**iv, "low": -0.05}, False, "cache") == "no difference seen"
    assert P.better({"value": 0.1, "low": None, "high": None, "n": 3}, False, "cache").startswith(
        "no interval"
    )
    trials = [
        {"original": {"kld": 0.1, "score": 1.0, "top1": 0.9}, "contiguous": {"kld": 0.3 + i / 100, "score": 0.0, "top1": 0.5}, "cache": {"kld": 0.1, "score": 1.0, "top1": 0.9}}
        for i in range(6)
    ]  # fmt: skip
    pooled = P.paired([[t] for t in trials], seed=0)
    b, c = P.claim(pooled, "contiguous", "b - a"), P.claim(pooled, "cache", "c - a")
    assert b["verdict"] == "original better" and b["outcome"] == "holds"
    assert c["verdict"] == "no difference seen" and c["outcome"] == "does not hold"
    assert "accuracy b - a -1" in b["measured"]
    few = P.claim(P.paired([[t] for t in trials[:3]], seed=0), "contiguous", "b - a")  # 3 trials: no interval
    assert few["verdict"].startswith("no interval") and few["outcome"] == "cannot decide"


def test_bad_options_are_refused(tiny, tmp_path):
    from kvlab.errors import BadInputError

    ctx = ExperimentContext(out_dir=tmp_path / "p", profile="quick", options={"ratioz": [0.5]})
    ctx.model_handle = tiny
    with pytest.raises(BadInputError, match="unknown option"):
        run_experiment(get_experiment("positions"), ctx)


@pytest.mark.real_model
@pytest.mark.slow
def test_bundled_model_smoke(smollm, tmp_path):
    """SmolLM2-135M, the quick profile cut to 2 trials: three conventions, verdicts written."""
    ctx = ExperimentContext(out_dir=tmp_path / "positions", profile="quick", options={"trials": 2})
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("positions"), ctx)
    assert result.status == "ok"
    assert all(v.startswith("no interval") for v in result.summary["verdicts"].values())  # 2 trials
