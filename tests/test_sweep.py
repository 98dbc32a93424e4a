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


@pytest.mark.real_model  # local_run: a sweep on the bundled model, in worker processes
@pytest.mark.process
def test_local_sweep_runs_every_cell_and_writes_one_report(local_run):
    tmp, result = local_run
    out = tmp / "out"
    assert len(result["cells"]) == 6 and result["failed"] == [] and result["ran"] == 6
    assert {c["status"] for c in result["cells"]} == {"ok"}
    page = (out / "index.html").read_text()
    for c in result["cells"]:
        assert (out / c["folder"] / "result.json").is_file() and f"{c['folder']}/index.html" in page
        assert c["smoke_result"] and not c["finding"] and c["headline"]  # a quick grid: smoke runs
    assert (out / "inspect.png").is_file() and (out / "transfer_equivalence.png").is_file()
    assert len({c["key"] for c in result["cells"]}) == 6
    assert {c["model_name"] for c in result["cells"]} >= {"SmolLM2-135M-Instruct"}


@pytest.mark.real_model  # local_run: a sweep on the bundled model, in worker processes
@pytest.mark.process
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


@pytest.mark.real_model  # local_run: a sweep on the bundled model, in worker processes
def test_ray_cluster_gives_the_same_cells_as_local(local_run, ray_cluster):
    tmp, _ = local_run
    out = tmp / "out-ray"
    run = _cli(str(tmp / "grid.toml"), "--out", str(out), "--ray", ray_cluster, "--json", cwd=tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["backend"] == f"ray:{ray_cluster}"
    assert _summaries(out) == _summaries(tmp / "out")


@pytest.mark.real_model  # local_run: a sweep on the bundled model, in worker processes
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


@pytest.mark.process
@pytest.mark.parametrize(
    "change, message",
    [
        ({"grid.toml": "missing.toml"}, "no grid file"),
        ({'profile = "quick"': "profile = [[["}, "not valid TOML"),
        ({'name = "inspect"': 'name = "no_such_experiment"'}, "unknown experiment"),
        ({"options = {": "options = { no_such_option = 1, "}, "has no option"),
        ({'models = ["': 'models = ["no-such-org/no-such-model", "'}, "never downloads"),
        ({'texts = ["text.txt"]': 'texts = ["absent.txt"]'}, "does not exist"),
        ({'profile = "quick"': 'profile = "quick"\ndevice = "gpu"'}, "unknown device 'gpu'"),
        ({'profile = "quick"': 'profile = "quick"\ndtype = "float7"'}, "unknown dtype 'float7'"),
        ({'profile = "quick"': 'profile = "quick"\ngpus_per_actor = -1'}, "'gpus_per_actor' must be"),
        ({'profile = "quick"': 'profile = "quick"\ndevice = "cuda:99"'}, "CUDA"),  # no such GPU here
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


# -- devices: the cell key, local sweeps, Ray actors asking for GPUs ---------------------------------------------


def test_device_and_dtype_are_part_of_the_cell_key(tmp_path):
    from kvlab.study.sweep.grid import cell_key, load_grid

    grid = load_grid(
        _grid(tmp_path, **{'profile = "quick"': 'profile = "quick"\ndevice = "cpu"\ndtype = "bf16"'})
    )
    assert (grid.device, grid.dtype, grid.gpus_per_actor) == ("cpu", "bfloat16", None)
    cell = grid.cells[0]
    keys = {
        (device, dtype): cell_key(cell, "fp", device, dtype)
        for device in ("cpu", "cuda", "cuda:0", "cuda:1")
        for dtype in ("float32", "bfloat16")
    }
    assert keys[("cuda:0", "float32")] == keys[("cuda:1", "float32")] == keys[("cuda", "float32")]  # any GPU
    assert len({keys[(d, t)] for d in ("cpu", "cuda") for t in ("float32", "bfloat16")}) == 4


def test_actors_ask_ray_for_the_gpus_the_grid_says():
    from kvlab.study.sweep.ray_backend import actor_options, gpus_per_actor_for

    assert actor_options(gpus_per_actor_for("cuda", None)) == {"num_cpus": 1, "num_gpus": 1.0}
    assert actor_options(gpus_per_actor_for("cuda", 0.5)) == {"num_cpus": 1, "num_gpus": 0.5}
    assert actor_options(gpus_per_actor_for("cpu", None)) == {"num_cpus": 1}
    assert actor_options(gpus_per_actor_for("cpu", 1.0)) == {"num_cpus": 1, "num_gpus": 1.0}
    with pytest.raises(BadInputError, match="gpus_per_actor > 0"):
        gpus_per_actor_for("cuda", 0.0)
    with pytest.raises(BadInputError, match='write device = "cuda"'):
        gpus_per_actor_for("cuda:1", None)


def _one_cell_grid(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "one.toml"
    path.write_text(
        f'models = ["tiny:{CONFIGS / "tinyllama-1.1b-chat-v1.0.json"}"]\n{extra}\n[[experiments]]\nname = "inspect"\n'
    )
    return path


@pytest.mark.process
def test_a_local_sweep_runs_on_its_device_and_resume_never_mixes_dtypes(tmp_path):
    """The grid's dtype reaches the cell's model; resuming with another --dtype re-runs every cell (its
    key changed) instead of taking the other dtype's results, and the same dtype again skips them."""
    grid = _one_cell_grid(tmp_path, 'device = "cpu"\ndtype = "bfloat16"')
    out = tmp_path / "out"
    first = _cli(str(grid), "--out", str(out), "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    doc = json.loads(first.stdout)
    (cell,) = doc["cells"]
    assert (doc["device"], doc["dtype"]) == ("cpu", "bfloat16") and cell["status"] == "ok"
    assert cell["ran_on"] == {"device": "cpu", "dtype": "bfloat16"} and cell["dtype"] == "bfloat16"
    other = _cli(str(grid), "--out", str(out), "--resume", "--dtype", "float32", "--json", cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-2000:]
    again = json.loads(other.stdout)
    assert again["ran"] == 1 and again["skipped"] == 0 and again["cells"][0]["ran_on"]["dtype"] == "float32"
    assert again["cells"][0]["key"] != cell["key"] and len(list((out / "cells").iterdir())) == 2
    same = _cli(str(grid), "--out", str(out), "--resume", "--dtype", "float32", "--json", cwd=tmp_path)
    assert same.returncode == 0 and json.loads(same.stdout)["skipped"] == 1


@pytest.fixture
def ray_gpu_node(tmp_path):
    """A one-node Ray cluster on 127.0.0.1 that declares one (logical) GPU: Ray schedules and assigns it
    like a real one, without a GPU in the machine."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray, "Ray is part of the dev extra: pip install -e '.[dev]'"
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO / "src")}
    try:
        subprocess.run(
            [
                ray,
                "start",
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                "--num-cpus=1",
                "--num-gpus=1",
                "--node-ip-address=127.0.0.1",
                "--disable-usage-stats",
            ],
            check=True,
            capture_output=True,
            timeout=120,
            env=env,
        )
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_ray_actors_get_the_gpus_the_grid_asks_for(tmp_path, ray_gpu_node):
    """gpus_per_actor reaches Ray: the actor that ran the cell was assigned the node's GPU (the cell
    itself runs on cpu, as the grid says, since this machine has no GPU). Asking for more GPUs than the
    cluster has is one line and exit 2, with nothing created."""
    grid = _one_cell_grid(tmp_path, 'device = "cpu"\ngpus_per_actor = 1')
    run = _cli(str(grid), "--out", str(tmp_path / "out"), "--ray", ray_gpu_node, "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout)
    (cell,) = doc["cells"]
    assert doc["gpus_per_actor"] == 1.0 and cell["status"] == "ok"
    assert cell["ray"]["gpu_ids"] == ["0"] and cell["ran_on"]["device"] == "cpu"
    on_disk = json.loads((tmp_path / "out" / cell["folder"] / "cell.json").read_text())
    assert on_disk["ray"]["gpu_ids"] == ["0"]
    too_many = _one_cell_grid(tmp_path, 'device = "cpu"\ngpus_per_actor = 2')
    refused = _cli(str(too_many), "--out", str(tmp_path / "out2"), "--ray", ray_gpu_node, cwd=tmp_path)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "has 1" in lines[0], refused.stderr[-2000:]
    assert not (tmp_path / "out2").exists()
