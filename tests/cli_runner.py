"""Running ``kvlab`` command lines as a user's shell would, many at once, each with a deadline.

Used by the bad-input tables (``tests/test_cli_errors.py``, ``tests/test_cli_hostile.py``): every case
runs in its own process, in its own fresh, empty folder, with stdin on /dev/null, as the leader of its
own process group (so a hang is killed with whatever it started), and is killed at its deadline.

By default the cases are forked from one server process that imported kvlab's CLI, torch and
transformers once (``tests/cli_forkserver.py``): the same ``kvlab.cli.main`` a shell runs, without
paying seconds of imports per case. ``KVLAB_CLI_TABLES_SUBPROCESS=1`` runs each case as its own
``python -m kvlab`` instead (slower; what the tables did before), and ``run_kvlab`` always does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Seconds one bad command line may take: every case fails while parsing or validating, before any model
#: loads (the slowest import torch and transformers, a few seconds on a loaded 2-core machine); a hang
#: fails its test here instead of stalling the suite.
CASE_TIMEOUT_S = 30


@dataclass
class Outcome:
    argv: list[str]
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float
    cwd: Path

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_kvlab(argv: list[str], cwd: Path, timeout: float = CASE_TIMEOUT_S) -> Outcome:
    """``python -m kvlab ARGV`` in ``cwd``, killed (with its process group) after ``timeout`` seconds."""
    env = _env()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlab", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return Outcome(argv, code, out, err, time.perf_counter() - start, cwd)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


class Runner:
    """Runs the submitted cases, each in ``root/case-NNN`` (created empty), at most ``workers`` at a
    time: all at once through the fork server on the first :meth:`result`, or (with
    ``KVLAB_CLI_TABLES_SUBPROCESS=1``) each as its own ``python -m kvlab`` in a thread pool."""

    def __init__(self, root: Path, workers: int | None = None, timeout: float = CASE_TIMEOUT_S) -> None:
        self.root, self.timeout = root, timeout
        self.workers = workers or max(2, min(4, os.cpu_count() or 2))
        self.forked = os.environ.get("KVLAB_CLI_TABLES_SUBPROCESS", "") in ("", "0")
        self.pool = None if self.forked else ThreadPoolExecutor(max_workers=self.workers)
        self.cases: dict[str, tuple[list[str], Path]] = {}
        self.futures: dict[str, Future[Outcome]] = {}
        self.outcomes: dict[str, Outcome] | None = None

    def submit(self, key: str, argv: list[str]) -> None:
        if key in self.cases:
            return
        cwd = self.root / f"case-{len(self.cases):03d}"
        cwd.mkdir()
        self.cases[key] = (argv, cwd)
        if self.pool is not None:
            self.futures[key] = self.pool.submit(run_kvlab, argv, cwd, self.timeout)

    def result(self, key: str) -> Outcome:
        if self.pool is not None:
            return self.futures[key].result()
        if self.outcomes is None:
            self.outcomes = self._run_forked()
        return self.outcomes[key]

    def _run_forked(self) -> dict[str, Outcome]:
        requests = [
            {"key": key, "argv": argv, "cwd": str(cwd), "timeout": self.timeout}
            for key, (argv, cwd) in self.cases.items()
        ]
        server = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("cli_forkserver.py")), str(self.workers)],
            input=json.dumps(requests),
            capture_output=True,
            text=True,
            cwd=self.root,
            env=_env(),
            # every case has its own deadline; this only bounds a server that itself went wrong
            timeout=120 + self.timeout * len(requests) / self.workers,
        )
        assert server.returncode == 0, server.stderr[-3000:]
        outcomes = {}
        for line in server.stdout.splitlines():
            doc = json.loads(line)
            argv, cwd = self.cases[doc["key"]]
            out, err = (Path(f"{cwd}.{name}").read_text(errors="replace") for name in ("stdout", "stderr"))
            outcomes[doc["key"]] = Outcome(argv, doc["returncode"], out, err, doc["seconds"], cwd)
        assert set(outcomes) == set(self.cases), "the fork server lost cases"
        return outcomes

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def selected_params(request, test_name: str, param: str) -> list:
    """The values of ``param`` for the items of ``test_name`` this session runs (after -k / node ids),
    so a fixture starts only the cases that will be asserted."""
    out = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.originalname == test_name and callspec is not None and param in callspec.params:
            out.append(callspec.params[param])
    return out


def assert_one_line_exit_2(outcome: Outcome, fragment: str, *, usage_ok: bool = False) -> None:
    """Exit 2, no traceback, exactly one line on stderr holding ``fragment``, within the deadline, and
    nothing left in the case's folder."""
    where = " ".join(outcome.argv)[:300]
    assert outcome.returncode is not None, f"hung: killed after {outcome.seconds:.0f} s: {where}"
    assert outcome.returncode == 2, (outcome.returncode, outcome.stderr[-2000:], where)
    assert "Traceback" not in outcome.stderr and "Traceback" not in outcome.stdout, outcome.stderr[-3000:]
    if usage_ok:
        assert "Usage" in outcome.stdout + outcome.stderr
    else:
        lines = outcome.error_lines
        assert len(lines) == 1, (lines, where)
        assert fragment in lines[0], (fragment, lines[0])
    left = sorted(p.name for p in outcome.cwd.iterdir())
    assert left == [], f"{where} left {left} behind"
