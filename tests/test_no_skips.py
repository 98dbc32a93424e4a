"""With KVLAB_TEST_NO_SKIPS=1 (make test, CI) a skipped test fails the run and is named; without it, a
skip is only reported. Runs pytest in a subprocess on a copy of tests/conftest.py and one skipping test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # pytest in a subprocess


def _run(tmp_path: Path, no_skips: str | None) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "def test_needs_tool():\n    pytest.skip('frobnicate is not installed (apt-get install -y frobnicate)')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVLAB_TEST_NO_SKIPS"}
    if no_skips is not None:
        env["KVLAB_TEST_NO_SKIPS"] = no_skips
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_skip_fails_the_run_under_no_skips(tmp_path):
    proc = _run(tmp_path, "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "KVLAB_TEST_NO_SKIPS=1: 1 test(s) skipped" in proc.stdout
    assert "test_x.py::test_needs_tool" in proc.stdout and "apt-get install -y frobnicate" in proc.stdout


def test_a_skip_is_only_reported_otherwise(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout and "KVLAB_TEST_NO_SKIPS" not in proc.stdout
