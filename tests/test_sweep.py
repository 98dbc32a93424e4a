"""``kvlab sweep``: a small grid (the bundled model and two tiny random models x two experiments) run locally and on a real two-node Ray cluster on 127.0.0.1 gives
identical cells; --resume finishes only what is missing; a worker killed with SIGKILL is retried;
bad input is one line and exit 2 with nothing created."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.errors import BadInputError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "model-configs"
pytestmark = pytest.mark.slow


def _grid(tmp_path: Path, **extra: str) -> Path:
    text = tmp_path / "text.txt"
    text.write_text("The cache holds keys and values. " * 40)
    body = f"""
profile = "quick"
seeds = [0]
models = ["smollm2-135m", "tiny:{CONFIGS / "tinyllama-1.1b-chat-v1.0.json"}", "tiny:{CONFIGS / "qwen2.5-7b.json"}"]
texts = ["text.txt"]

[[experiments]]
name = "inspect"

[[experiments]]
name = "transfer_equivalence"
options = {{ pairs = 2, kept_generated = 2 }}
"""
    for key, value in extra.items():
        body = body.replace(key, value)
    path = tmp_path / "grid.toml"
    path.write_text(body)
    return path


def _cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    return subprocess.run(
        [sys.executable, "-m", "kvlab", "sweep", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def _summaries(out: Path) -> dict[str, str]:
    cells = json.loads((out / "result.json").read_text())["cells"]
    return {c["key"]: json.dumps(c["summary"], sort_keys=True) for c in cells}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    from kvlab.study.sweep import run_sweep

    tmp = tmp_path_factory.mktemp("sweep-local")
    result = run_sweep(_grid(tmp), tmp / "out", workers=2)
    return tmp, result


def test_local_sweep_runs_every_cell_and_writes_one_report(local_run):
    tmp, result = local_run
    out = tmp / "out"
    assert len(result["cells"]) == 6 and result["failed"] == [] and result["ran"] == 6
    assert {c["status"] for c in result["cells"]} == {"ok"}
    page = (out / "index.html").read_text()
    for c in result["cells"]:
        assert (out / c["folder"] / "result.json").is_file() and f"{c['folder']}/index.html" in page
        assert c["finding"] and c["headline"]
    assert (out / "inspect.png").is_file() and (out / "transfer_equivalence.png").is_file()
    assert len({c["key"] for c in result["cells"]}) == 6
    assert {c["model_name"] for c in result["cells"]} >= {"SmolLM2-135M-Instruct"}


def test_resume_runs_only_what_is_missing(local_run, tmp_path):
    tmp, result = local_run
    out = tmp_path / "out"
    shutil.copytree(tmp / "out", out)
    victim = out / result["cells"][1]["folder"]
    shutil.rmtree(victim)
    (out / "cells" / ".half-written.123.abcd.tmp").mkdir()  # what a killed driver leaves
    again = _cli(str(tmp / "grid.toml"), "--out", str(out), "--resume", "--json", cwd=tmp)
    assert again.returncode == 0, again.stderr[-2000:]
    doc = json.loads(again.stdout)
    assert doc["ran"] == 1 and doc["skipped"] == 5 and victim.is_dir()
    assert _summaries(out) == _summaries(tmp / "out")
    refused = _cli(
        str(tmp / "grid.toml"), "--out", str(out), cwd=tmp
    )  # without --resume: refuse, touch nothing
    assert refused.returncode == 2 and "--resume" in refused.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster(tmp_path):
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray, "Ray is part of the dev extra: pip install -e '.[dev]'"
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO / "src")}
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    try:
        subprocess.run(
            [ray, "start", "--head", f"--port={port}", "--include-dashboard=false", *common],
            check=True,
            capture_output=True,
            timeout=120,
            env=env,
        )
        subprocess.run(
            [ray, "start", f"--address=127.0.0.1:{port}", *common],
            check=True,
            capture_output=True,
            timeout=120,
            env=env,
        )
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_ray_cluster_gives_the_same_cells_as_local(local_run, ray_cluster):
    tmp, _ = local_run
    out = tmp / "out-ray"
    run = _cli(str(tmp / "grid.toml"), "--out", str(out), "--ray", ray_cluster, "--json", cwd=tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["backend"] == f"ray:{ray_cluster}"
    assert _summaries(out) == _summaries(tmp / "out")


def test_a_ray_worker_killed_mid_sweep_is_retried(local_run, ray_cluster, tmp_path):
    tmp, _ = local_run
    out = tmp_path / "out-killed"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvlab",
            "sweep",
            str(tmp / "grid.toml"),
            "--out",
            str(out),
            "--ray",
            ray_cluster,
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
        env=env,
    )
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline and driver.poll() is None:
        ps = subprocess.run(["pgrep", "-f", "ray::CellWorker"], capture_output=True, text=True).stdout.split()
        if ps:
            killed = int(ps[0])
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    stdout, stderr = driver.communicate(timeout=600)
    assert killed is not None, "no Ray worker process was seen"
    assert driver.returncode == 0, stderr[-3000:]
    doc = json.loads(stdout)
    assert doc["failed"] == [] and {c["status"] for c in doc["cells"]} == {"ok"}
    assert _summaries(out) == _summaries(tmp / "out")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"grid.toml": "missing.toml"}, "no grid file"),
        ({'profile = "quick"': "profile = [[["}, "not valid TOML"),
        ({'name = "inspect"': 'name = "no_such_experiment"'}, "unknown experiment"),
        ({"options = {": "options = { no_such_option = 1, "}, "has no option"),
        ({'models = ["': 'models = ["no-such-org/no-such-model", "'}, "never downloads"),
        ({'texts = ["text.txt"]': 'texts = ["absent.txt"]'}, "does not exist"),
    ],
)
def test_bad_grids_are_one_line_and_create_nothing(tmp_path, change, message):
    target = "grid.toml"
    grid = _grid(tmp_path, **{k: v for k, v in change.items() if k != "grid.toml"})
    if "grid.toml" in change:
        target = change["grid.toml"]
    run = _cli(str(grid.parent / target), "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1 and message in lines[0], run.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_run_sweep_refuses_a_file_as_out(tmp_path):
    from kvlab.study.sweep import run_sweep

    (tmp_path / "f").write_text("x")
    with pytest.raises(BadInputError, match="is a file"):
        run_sweep(_grid(tmp_path), tmp_path / "f")
