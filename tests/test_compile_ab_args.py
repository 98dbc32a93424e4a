"""``benchmarks/compile_ab.py`` refuses a bad command line in one line and exit 2, before torch loads, and
reports B against A over its compiles (a ratio of geometric means, an interval over the compiles)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import compile_ab  # noqa: E402
from _common import Refusal  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--compiles", "4"], "--compiles must be 5 to 10"),
        (["--rounds", "4"], "--rounds must be at least 5"),
        (["--b", "cpp_wrapper"], "a setting is key=value"),
        (["--a", "cpp_wrapper=yes please"], "not a Python literal"),
    ],
)
def test_a_bad_command_line_is_refused(argv, says):
    with pytest.raises(Refusal, match=says):
        compile_ab.parse(argv)


@pytest.mark.process
def test_the_refusal_is_one_line_and_exit_2_without_torch():
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['compile_ab.py', '--compiles', '2']\n"
        "try:\n"
        f"    runpy.run_path({str(BENCH / 'compile_ab.py')!r}, run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"]
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: --compiles must be 5 to 10 (an interval over fewer than 5 is not given), not 2"]


def test_the_report_compares_compiles_not_blocks():
    args = SimpleNamespace(compiles=5, rounds=5, steps=16)
    blocks = [("AB"[k % 2], None) for k in range(10)]
    # arm A's compiles at 50 ms, B's at 45 ms, with a spread between compiles and none within one
    spread = [1.0, 1.02, 0.98, 1.01, 0.99]
    times = [[(50.0 if k % 2 == 0 else 45.0) * spread[k // 2]] * 5 for k in range(10)]
    text = compile_ab.report(
        args, {"A": {"x": 1}, "B": {"x": 2}}, blocks, times, [60.0] * 10, 0.0, ["Python", "C++"] * 5
    )
    assert "**B / A, ms per step: 0.900x**" in text
    low, high = (float(x) for x in text.split("95% interval [")[1].split("]")[0].split(", "))
    assert low < 0.9 < high and math.isclose(low * high, 0.81, rel_tol=1e-3)  # symmetric in log
    assert text.count("\n| ") == 11  # a header and a raw row per compile
