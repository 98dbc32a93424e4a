"""The markers `make test-fast` deselects by (real_model, process, slow) are complete and enforced:
tests/conftest.py marks a test from its fixtures, fails collection when a test's own code starts a
process without the marker, and fails a test that loads the bundled model without real_model."""

from __future__ import annotations

import textwrap

import pytest

import tests.conftest as suite

SAMPLE = """
import subprocess
from subprocess import Popen
import multiprocessing as mp


class Server:
    def __init__(self):
        self.proc = Popen(["sleep", "60"])


def _helper():
    return subprocess.run(["true"])


def _quiet(server: Server):
    return subprocess.PIPE, subprocess.TimeoutExpired


def test_direct():
    subprocess.check_output(["true"])


def test_through_a_helper():
    _helper()


def test_through_a_class():
    Server()


def test_a_context_process():
    mp.get_context("spawn").Process(target=print).start()


def test_names_and_annotations_only(server):
    _quiet(server)
    assert subprocess.DEVNULL
"""


def test_the_scan_sees_direct_and_indirect_process_starts(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text(SAMPLE)
    seen = {name: suite.starts_process(str(path), name) for name in ("test_direct", "test_through_a_helper")}
    seen |= {name: suite.starts_process(str(path), name) for name in ("test_through_a_class", "Server")}
    seen["test_a_context_process"] = suite.starts_process(str(path), "test_a_context_process")
    assert all(seen.values()), seen
    # constants, exception types and a parameter annotated with a process-starting class start nothing
    assert not suite.starts_process(str(path), "test_names_and_annotations_only")
    assert not suite.starts_process(str(path), "_quiet")


@pytest.fixture
def sample(pytester):
    """A suite with the markers' hook of tests/conftest.py (nothing in it runs: collection only)."""
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    real_model: x\n    process: x\n    slow: x\n"
    )
    pytester.makeconftest(
        textwrap.dedent(
            """
            import subprocess

            import pytest

            from tests.conftest import pytest_collection_modifyitems  # noqa: F401


            @pytest.fixture(scope="session")
            def smollm():
                return "stands in for the bundled model"


            @pytest.fixture
            def server():
                proc = subprocess.Popen(["sleep", "60"])
                yield proc
                proc.kill()
            """
        )
    )
    return pytester


def test_an_unmarked_test_that_starts_a_process_fails_collection(sample):
    sample.makepyfile(
        test_a="import subprocess\n\ndef test_runs_true():\n    subprocess.run(['true'])\n\n"
        "def test_plain():\n    assert 1\n"
    )
    result = sample.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*1 test(s) start a process but are not marked process*", "*test_runs_true*"]
    )
    assert "test_plain" not in result.stderr.str()


def test_a_marked_one_passes_and_fixtures_mark_their_tests(sample):
    sample.makepyfile(
        test_a="import subprocess\n\nimport pytest\n\n@pytest.mark.process\n"
        "def test_runs_true():\n    subprocess.run(['true'])\n\n"
        "def test_model(smollm):\n    assert smollm\n\n"
        "def test_server(server):\n    assert server\n\n"
        "def test_plain():\n    assert 1\n"
    )
    picked = {}
    for expr in ("process", "real_model", "not process and not real_model"):
        result = sample.runpytest("--collect-only", "-q", "-m", expr)
        assert result.ret == pytest.ExitCode.OK, result.stderr.str()
        picked[expr] = sorted(line.split("::")[1] for line in result.outlines if "::" in line)
    assert picked == {
        "process": ["test_runs_true", "test_server"],
        "real_model": ["test_model"],
        "not process and not real_model": ["test_plain"],
    }


def test_an_unmarked_test_that_loads_the_bundled_model_fails_before_anything_loads():
    """This test is not marked real_model: the guard fails it at the first step towards the model."""
    from kvlab.model import loading

    with pytest.raises(pytest.fail.Exception, match="loads the bundled model: mark it real_model"):
        loading.bundled_model_dir()
    with pytest.raises(pytest.fail.Exception, match="mark it real_model"):
        loading.resolve_model_dir("smollm2-135m")
