"""``benchmarks/gemv_rate.py`` refuses a bad command line before torch loads, and reports each arm's rate,
its share of the fastest read and its time paired round by round against inductor's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import gemv_rate  # noqa: E402
from _common import Refusal  # noqa: E402


@pytest.mark.parametrize("rounds", ["4", "0", "201"])
def test_too_few_or_too_many_rounds_are_refused(rounds):
    with pytest.raises(Refusal, match="--rounds must be 5 to 200"):
        gemv_rate.parse(["--rounds", rounds])


@pytest.mark.process
def test_parse_imports_no_torch():
    import subprocess

    probe = (
        "import sys\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "import gemv_rate\n"
        "try:\n"
        "    gemv_rate.parse(['--rounds', '2'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"]


def test_the_report_pairs_every_arm_with_inductor():
    times = {
        "inductor": [0.050, 0.052, 0.048, 0.051, 0.049],
        "streams": [0.045, 0.0468, 0.0432, 0.0459, 0.0441],  # 0.9x inductor's, round by round
        "read_streams": [0.040] * 5,
    }
    text = gemv_rate.report(times, {"inductor": 1e-5}, 400_000_000, 211, 90.0)
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ")
    }
    assert rows["streams"][4] == "0.900x" and rows["streams"][5] == "[0.90, 0.90]"
    assert rows["read_streams"][3] == "100%" and rows["read_streams"][2] == "10.00"
    assert rows["inductor"][3] == "80%"  # 400 MB / 50 ms against 400 MB / 40 ms


def test_the_steps_without_their_checks_are_paired_against_the_step():
    step = [0.044, 0.046, 0.042, 0.045, 0.043]
    times = {
        "inductor": [0.040] * 5,
        "step": step,
        "step_unguarded": [x * 0.95 for x in step],  # 0.95x the step's time, round by round
    }
    text = gemv_rate.report(times, {}, 400_000_000, 211, 90.0)
    tail = text.split("paired round by round against the step:")[1]
    row = next(line.split(" | ") for line in tail.splitlines() if line.startswith("| step_unguarded"))
    assert row[1] == "0.950x" and row[2] == "[0.95, 0.95]"
    assert row[3].strip(" |") == f"{0.044 * 0.05 * 1e3:.2f}"  # the median round's 5%


def test_without_a_step_arm_there_is_no_checks_table():
    text = gemv_rate.report({"inductor": [0.040] * 5, "aten": [0.041] * 5}, {}, 400_000_000, 211, 90.0)
    assert "against the step" not in text
