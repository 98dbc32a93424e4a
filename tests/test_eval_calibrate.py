"""kvlab.eval.calibrate on fake scorers: the in-band setting nearest 0.8 is chosen, a task with none is apart,
stopping early gives the verdicts the full n gives, calibration seeds are never an eval's; and
benchmarks/eval_ruler.py reads a calibration (knobs per task, apart tasks out of every pooled figure)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from kvlab.errors import BadInputError
from kvlab.eval.calibrate import (
    BAND,
    LADDERS,
    MIN_TRIALS,
    Calibration,
    Setting,
    calibrate,
    calibrate_task,
    calibration_seed,
    check_disjoint,
    try_setting,
)
from kvlab.eval.run import run_suite
from kvlab.eval.specs import parse_cache_specs
from kvlab.eval.tasks import TASKS, make_trial, trial_seed
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_ruler  # noqa: E402


def fake(accuracy: dict[str, list[float]], calls: list | None = None):
    """A scorer whose full cache scores 1 with probability ``accuracy[task][rung]`` (seeded per trial)."""

    def score(task, length, seed, knobs):
        rungs = [TASKS[task].resolve(k) for k in LADDERS[task]]
        rung = rungs.index(TASKS[task].resolve(knobs))
        if calls is not None:
            calls.append((task, rung, seed))
        return float(random.Random(f"{task}/{rung}/{seed}").random() < accuracy[task][rung])

    return score


def test_every_ladder_holds_the_default_and_distinct_settings():
    assert sorted(LADDERS) == sorted(TASKS)
    for task, ladder in LADDERS.items():
        resolved = [TASKS[task].resolve(k) for k in ladder]
        assert dict(TASKS[task].knobs) in resolved
        assert len({json.dumps(r, sort_keys=True) for r in resolved}) == len(ladder)


def test_calibration_seeds_are_never_evaluation_seeds():
    cal = {calibration_seed(i) for i in range(10_000)}
    assert len(cal) == 10_000 and max(cal) == -1
    evaluation = {trial_seed(s, i) for s in range(0, 50) for i in range(0, 2_000)}
    assert not cal & evaluation
    check_disjoint(evaluation)
    with pytest.raises(BadInputError, match="negative"):
        check_disjoint([trial_seed(-1, 5)])
    with pytest.raises(BadInputError):
        calibration_seed(-1)


def test_the_in_band_setting_nearest_08_is_chosen():
    calls: list = []
    # niah_single: the default (rung 0) at the ceiling, rung 3 at 0.93, rung 4 at 0.75
    got = calibrate_task(fake({"niah_single": [1, 1, 1, 0.93, 0.75, 0.4]}, calls), "niah_single", 1024)
    assert got["status"] == "pooled" and got["knobs"] == LADDERS["niah_single"][4]
    assert got["n"] == MIN_TRIALS and BAND[0] <= got["accuracy"]["value"] <= BAND[1]
    tried = [t["knobs"] for t in got["tried"]]
    assert tried[0] == {} and got["tried"][0]["verdict"] == "above"
    assert {s for _, _, s in calls} == {
        calibration_seed(i) for i in range(MIN_TRIALS)
    }  # the same seeds per rung
    chosen = next(t for t in got["tried"] if t["knobs"] == got["knobs"])
    assert chosen["stopped_early"] is False and len(chosen["scores"]) == MIN_TRIALS


def test_a_task_in_band_at_its_default_runs_one_setting():
    got = calibrate_task(fake({"qa": [1, 1, 0.8, 0.5, 0.3, 0.2, 0.1]}), "qa", 4096)
    assert got["status"] == "pooled" and got["knobs"] == {} and len(got["tried"]) == 1


def test_a_task_with_no_setting_in_band_is_apart_and_not_pooled():
    got = calibrate_task(fake({"vt": [0.5, 0, 0, 0, 0, 0]}), "vt", 1024)
    assert got["status"] == "apart" and all(t["verdict"] == "below" for t in got["tried"])
    assert got["knobs"] == {"hops": 1}  # the setting nearest the band, recorded for the apart report
    doc = calibrate(
        fake({"vt": [0.5, 0, 0, 0, 0, 0], "qa": [1, 1, 0.8, 0.5, 0.3, 0.2, 0.1]}), ["vt", "qa"], [1024]
    )
    cal = Calibration.from_json(json.loads(json.dumps(doc)))
    assert (
        cal.apart() == {("vt", 1024)} and cal.knobs("qa", 1024) == {} and cal.knobs("vt", 1024) == {"hops": 1}
    )
    with pytest.raises(BadInputError, match="no entry"):
        cal.knobs("qa", 4096)


def test_stopping_early_gives_the_verdict_the_full_n_gives():
    for p in (0.0, 0.1, 0.3, 0.55, 0.6, 0.7, 0.9, 0.95, 0.97, 1.0):
        for trial in range(5):
            scores = [float(random.Random(f"{p}/{trial}/{i}").random() < p) for i in range(MIN_TRIALS)]
            early = try_setting(
                lambda t, n, s, k, scores=scores: scores[-s - 1], "qa", 1024, {}, stop_early=True
            )
            full = try_setting(
                lambda t, n, s, k, scores=scores: scores[-s - 1], "qa", 1024, {}, stop_early=False
            )
            assert full.verdict(BAND) in ("in band", "above", "below")
            assert early.verdict(BAND) == full.verdict(BAND)
            assert early.scores == full.scores[: len(early.scores)]
    assert Setting({}, 30, scores=[1.0] * 10).verdict(BAND) == "undecided"


def test_partial_credit_scores_and_rows_are_kept():
    s = try_setting(
        lambda t, n, seed, k: {"score": 0.75, "output": "x", "seed": seed}, "cwe", 512, {"words": 3}
    )
    js = s.to_json(BAND)
    assert js["verdict"] == "in band" and js["accuracy"]["value"] == 0.75 and len(js["rows"]) == MIN_TRIALS
    assert (
        js["interval_in_band"] is False
    )  # Wilson's [0.57, 0.87] at n = 30: the mean is in, the interval not
    assert Setting({}, 30, scores=[0.8] * 30).to_json(BAND)["interval_in_band"] is True
    with pytest.raises(BadInputError, match="lie in"):
        try_setting(lambda *a: 1.5, "qa", 512, {})


def test_bad_calibrations_are_refused(tmp_path):
    with pytest.raises(BadInputError, match="at least"):
        calibrate_task(fake({}), "qa", 1024, n=10)
    with pytest.raises(BadInputError, match="no knob"):
        calibrate_task(fake({}), "qa", 1024, ladder=[{}, {"keys": 3}])
    with pytest.raises(BadInputError, match="default"):
        calibrate_task(fake({}), "qa", 1024, ladder=[{"people": 2}])
    with pytest.raises(BadInputError, match="not a kvlab eval calibration"):
        Calibration.from_json({"tasks": []})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BadInputError, match="cannot read"):
        Calibration.read(tmp_path / "bad.json")


# -- the eval reads a calibration ------------------------------------------------------------------------
def _calibration_file(tmp_path: Path) -> Path:
    doc = calibrate(
        fake({"niah_single": [1, 1, 0.8, 0.5, 0.3, 0.2], "vt": [0.5, 0, 0, 0, 0, 0]}),
        ["niah_single", "vt"],
        [200],
    )
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_eval_reads_the_knobs_and_leaves_apart_tasks_out_of_the_pool(tmp_path):
    path = _calibration_file(tmp_path)
    args = eval_ruler.parse_args(
        ["--tasks", "niah_single,vt", "--lengths", "200", "--calibration", str(path)]
    )
    knobs, apart = eval_ruler.calibration_of(args)
    assert knobs == {("niah_single", 200): {"keys": 3}, ("vt", 200): {"hops": 1}} and apart == {("vt", 200)}
    rows = [
        {
            "task": t,
            "length": 200,
            "trial": i,
            "kind": "full",
            "spec": "full",
            "score": s,
            "kld": 0.0,
            "top1": 1.0,
        }
        for t, s in (("niah_single", 1.0), ("vt", 0.0))
        for i in range(6)
    ]
    (pool,) = eval_ruler.pooled(eval_ruler.pooled_rows(rows, apart), 0)
    assert pool["trials"] == 6 and pool["accuracy"]["value"] == 1.0  # vt's zeros are not pooled
    assert (
        "vt @ 200"
        in eval_ruler.calibration_lines(
            {
                "file": str(path),
                "knobs": [{"task": "vt", "length": 200, "knobs": {"hops": 1}}],
                "apart": [("vt", 200)],
            }
        )[0]
    )
    assert eval_ruler.calibration_of(eval_ruler.parse_args([])) == ({}, set())


def test_the_eval_refuses_seeds_or_lengths_the_calibration_cannot_serve(tmp_path):
    path = _calibration_file(tmp_path)
    with pytest.raises(eval_ruler.Refusal, match="negative"):
        eval_ruler.calibration_of(
            eval_ruler.parse_args(
                ["--tasks", "vt", "--lengths", "200", "--seed", "-1", "--calibration", str(path)]
            )
        )
    with pytest.raises(eval_ruler.Refusal, match="no entry"):
        eval_ruler.calibration_of(
            eval_ruler.parse_args(["--tasks", "vt", "--lengths", "512", "--calibration", str(path)])
        )


def test_run_suite_builds_trials_with_the_knobs(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    seen: list = []
    run_suite(
        handle,
        parse_cache_specs(["full"]),
        tasks=["vt"],
        lengths=[200],
        trials=1,
        haystack_text=HAYSTACK,
        max_new_tokens=2,
        on_reference=lambda ref: seen.append(ref["trial"]),
        knobs={("vt", 200): {"hops": 2}},
    )
    assert seen[0] == make_trial("vt", handle, 200, trial_seed(0, 0), HAYSTACK, {"hops": 2})
    assert len(seen[0].answers) == 3


# -- kvlab eval ruler --calibration ------------------------------------------------------------------------
def _ruler_cli(capsys, *args):
    from kvlab.cli import main

    code = main(["eval", "ruler", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cli_refuses_a_calibration_it_cannot_serve_before_loading(tmp_path, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    path = _calibration_file(tmp_path)
    for args, why in (
        (["--tasks", "vt", "--lengths", "512"], "no entry for vt at 512"),
        (["--tasks", "qa", "--lengths", "200"], "no entry for qa at 200"),
        (["--tasks", "vt", "--lengths", "200", "--seed", "-1"], "--seed"),  # calibration seeds are negative
    ):
        code, out, err = _ruler_cli(capsys, *args, "--calibration", str(path))
        assert code == 2 and not out and why in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "bad.json").write_text("{")
    code, _, err = _ruler_cli(capsys, "--calibration", str(tmp_path / "bad.json"))
    assert code == 2 and "cannot read" in err
    gemma = tmp_path / "gemma.json"  # a task's difficulty is its model's: another model's calibration refused
    gemma.write_text(json.dumps({**json.loads(path.read_text()), "model_spec": "gemma3-270m"}))
    args = ["--tasks", "vt", "--lengths", "200", "--calibration", str(gemma)]
    code, out, err = _ruler_cli(capsys, *args)
    assert code == 2 and not out and "calibrate smollm2-135m first" in err, err
    # an alias of the calibrated model passes, to the next check (a length it lacks)
    code, out, err = _ruler_cli(
        capsys, "--tasks", "vt", "--lengths", "512", "--calibration", str(gemma), "-m", "gemma3"
    )
    assert code == 2 and "no entry for vt at 512" in err, err


def test_the_cli_runs_each_task_at_its_calibrated_knobs(tiny_llama_2x64, tmp_path, monkeypatch, capsys):
    """The run's trials are the calibrated ones (the same ids as make_trial with the knobs), and ruler.json
    records the calibration, its knobs and the tasks it left apart."""
    import kvlab
    from kvlab.model.handle import ModelHandle

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: handle)
    text = tmp_path / "haystack.txt"
    text.write_text(HAYSTACK)
    path = _calibration_file(tmp_path)
    out_dir = tmp_path / "run"
    args = ["--tasks", "niah_single,vt", "--lengths", "200", "--trials", "1", "--haystack", str(text)]
    code, out, err = _ruler_cli(capsys, *args, "--calibration", str(path), "--out", str(out_dir), "-n", "2")
    assert code == 0, err
    assert "apart (no difficulty put the full cache in the calibration's band" in out and "vt@200" in out
    doc = json.loads((out_dir / "ruler.json").read_text())
    settings = doc["settings"]
    assert settings["knobs"] == {"niah_single@200": {"keys": 3}, "vt@200": {"hops": 1}}
    assert settings["apart"] == ["vt@200"] and settings["calibration"] == str(path)
    default = make_trial("niah_single", handle, 200, trial_seed(0, 0), HAYSTACK)
    for row in doc["rows"]:
        want = make_trial(
            row["task"], handle, 200, trial_seed(0, 0), HAYSTACK, settings["knobs"][f"{row['task']}@200"]
        )
        assert row["answers"] == list(want.answers)
        if row["task"] == "niah_single":  # three keys, not the default one: another trial
            assert row["answers"] != list(default.answers) or want.context != default.context
            assert list(want.answers) != list(default.answers) or want.context != default.context
