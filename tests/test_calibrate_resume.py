"""``benchmarks/calibrate_ruler.py --resume``: a stopped calibration goes on from the trials it recorded.

The walk over a task's ladder is a function of its trials' scores, so replaying recorded trials retraces it;
only trials not recorded run. Checked here without a model: a recorded trial is returned as recorded, and
the walk of :func:`kvlab.eval.calibrate.calibrate_task` over recorded scores is the walk over live ones.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvlab.eval.calibrate import calibrate_task

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cal():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "calibrate_ruler", ROOT / "benchmarks" / "calibrate_ruler.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake(task, length, seed, knobs):  # a deterministic "model": harder with more keys
    return {
        "seed": seed,
        "score": float((seed * 7 + 3 * knobs.get("keys", 1)) % 10 < 8 - knobs.get("keys", 1)),
    }


def test_recorded_trials_replay_the_same_walk_and_run_nothing(cal, tmp_path):
    trials = tmp_path / "cal.json.trials.jsonl"
    ran: list = []

    def live(task, length, seed, knobs):
        ran.append(seed)
        row = _fake(task, length, seed, knobs)
        with open(trials, "a") as f:
            f.write(json.dumps({"key": cal._key(task, length, seed, knobs), "row": row}) + "\n")
        return row

    first = calibrate_task(live, "niah_single", 1024)
    assert ran
    memo = cal.recorded(trials)
    assert len(memo) == len(ran)
    replay = cal.scorer(None, "", trials, memo)  # no model: every trial must come from the memo
    assert calibrate_task(replay, "niah_single", 1024) == first
    assert cal.recorded(tmp_path / "absent.jsonl") == {}
