"""``--device`` and ``--dtype`` on every command that loads a model, and ``--load-in-4bit``.

One library function resolves a device (``kvlab.model.resolve_device``: ``auto`` is CUDA when there is
one); the command line checks the flags at parse time (one line, exit code 2, nothing written); the
study's context and its worker processes load the model on that device in that dtype; reports record
where they ran. CUDA is simulated where a test needs it, so every test runs (and means the same) on a
machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.errors import BadInputError, UnsupportedModelError
from kvlab.model.loading import check_4bit, check_device_name, resolve_device

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "CUDA device(s)" if HAS_CUDA else "no CUDA"  # what asking for a missing GPU says here
MISSING_GPU = f"cuda:{torch.cuda.device_count()}" if HAS_CUDA else "cuda"  # a GPU this machine lacks
CAN_4BIT = HAS_CUDA and importlib.util.find_spec("bitsandbytes") is not None

# (argv, a fragment of the one error line). GRID is a valid sweep grid, OUT a folder that must not appear.
CASES = [
    (["inspect", "--device", "gpu"], "unknown device 'gpu'"),
    (["inspect", "--device", MISSING_GPU, "--out", "OUT"], NO_CUDA),
    (["study", "--device", MISSING_GPU, "--out", "OUT"], NO_CUDA),
    (["study", "--device", "cuda:x"], "unknown device"),
    (["serve", "--device", "tpu"], "unknown device 'tpu'"),
    (["serve", "--dtype", "float7"], "unknown dtype 'float7'"),
    (["generate", "hi", "--device", "cuda:99"], "CUDA device(s)" if HAS_CUDA else "no CUDA"),
    (["chat", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["generate", "hi", "--capture", "fast"], "not one of auto, off, cuda-graph, compile"),
    (["generate", "hi", "--capture", "cuda-graph", "--device", "cpu"], "needs a CUDA device"),
    (["roll", "sweep", "--dtype", "float7", "--out", "OUT"], "unknown dtype"),
    (["roll", "findings", "--device", "metal"], "unknown device"),
    (["attention", "--device", MISSING_GPU], NO_CUDA),
    (["transfer", "numerics", "--device", "cpu:0"], "unknown device"),
    (["compress", "--dtype", "half-ish"], "unknown dtype"),
    (["train-evictor", "--device", "cuda:-1"], "unknown device"),
    (["stream-ppl", "--device", MISSING_GPU], NO_CUDA),
    (["store", "put", "hi", "--store", "new-store", "--device", MISSING_GPU], NO_CUDA),
    (["store", "generate", "hi", "--store", "new-store", "--dtype", "x"], "unknown dtype"),
    (["store", "experiment", "--device", "gpu0"], "unknown device"),
    (["transfer", "finetune-derivative", "--device", MISSING_GPU], NO_CUDA),
    (["sweep", "GRID", "--out", "OUT", "--device", "gpu"], "unknown device"),
    (["sweep", "GRID", "--out", "OUT", "--dtype", "float7"], "unknown dtype"),
    (["inspect", "--dtype", "int8"], "--config only"),
    (
        ["inspect", "--load-in-4bit", "--device", "cpu", "--out", "OUT"],
        "need a CUDA GPU: the device asked for is cpu",
    ),
]
if not CAN_4BIT:  # where NF4 cannot run, the plain flag says why
    CASES.append(
        (["inspect", "--load-in-4bit", "--out", "OUT"], "need a CUDA GPU" if not HAS_CUDA else "bitsandbytes")
    )


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-device")
    (root / "grid.toml").write_text('models = ["smollm2-135m"]\n[[experiments]]\nname = "inspect"\n')
    return {"GRID": str(root / "grid.toml"), "OUT": str(root / "out"), "root": str(root)}


@pytest.mark.process
@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_device_or_dtype_is_one_line_exit_2_and_writes_nothing(where, argv, fragment):
    argv = [where.get(a, a) for a in argv]
    before = sorted(os.listdir(where["root"]))
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab", *argv],
        capture_output=True,
        text=True,
        cwd=where["root"],
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert fragment in lines[0], lines[0]
    assert sorted(os.listdir(where["root"])) == before  # no runs/, no store, no --out


def test_every_command_that_loads_a_model_takes_device_and_dtype():
    """--device and --dtype are on every command whose body loads a model (a new command must add them)."""
    import typer.main

    from kvlab.cli import app

    def commands(group, path=()):
        cli = typer.main.get_command(group) if not hasattr(group, "commands") else group
        for name, cmd in cli.commands.items():
            if hasattr(cmd, "commands"):
                yield from commands(cmd, (*path, name))
            else:
                yield (*path, name), {o for p in cmd.params for o in getattr(p, "opts", [])}

    no_model = {
        ("experiments",),
        ("model-path",),  # converts the bundled GGUF on the CPU, loads nothing onto a device
        ("probe",),  # an HTTP client of another server: loads no model
        ("gc",),
        ("store", "get"),
        ("store", "ls"),
        ("store", "stats"),
        ("store", "gc"),
        ("store", "verify"),
    }
    found = dict(commands(app))
    assert len(found) > 25
    for path, opts in found.items():
        if path not in no_model:
            assert {"--device", "--dtype"} <= opts, path
    assert "--load-in-4bit" in found[("inspect",)]


# -- the one resolver ------------------------------------------------------------------------------------------


def test_auto_resolves_to_cuda_when_there_is_one_else_cpu():
    expected = f"cuda:{torch.cuda.current_device()}" if HAS_CUDA else "cpu"
    assert resolve_device("auto") == resolve_device(None) == expected
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == "cpu"
    assert check_device_name(" CUDA:1 ") == "cuda:1" and check_device_name("auto") == "auto"
    for bad in ("gpu", "cuda:", "cuda:a", "cpu:0", "", "mps"):
        with pytest.raises(BadInputError, match="choose auto, cpu, cuda or cuda:N"):
            check_device_name(bad)


def test_resolution_with_cuda_and_without(monkeypatch):
    """Two (simulated) GPUs: auto and cuda are the current one, cuda:1 exists, cuda:2 does not. Without
    CUDA, the error names the torch build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(BadInputError, match=r"has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    from kvlab.study.runner import default_workers

    assert default_workers("auto") == default_workers("cuda") == 1  # one GPU is not shared by processes
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UnsupportedModelError, match="pip install bitsandbytes"):
        check_4bit("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadInputError, match=re.escape(f"torch {torch.__version__}")):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
    assert default_workers("auto") == max(1, min(4, os.cpu_count() or 1))


def test_load_model_refuses_a_missing_device_before_reading_anything(monkeypatch):
    from kvlab.model import load_model

    def no(*a, **k):
        raise AssertionError("the model was looked up")

    monkeypatch.setattr("kvlab.model.resolve_model_dir", no)
    with pytest.raises(BadInputError, match="device"):
        load_model("smollm2-135m", device="cuda:7" if HAS_CUDA else "cuda", reuse=False)
    with pytest.raises(UnsupportedModelError, match="4-bit"):
        load_model("smollm2-135m", device="cpu", load_in_4bit=True, reuse=False)


# -- the study: context, runner, workers ---------------------------------------------------------------------


def test_context_loads_on_its_device_in_its_dtype(monkeypatch, tmp_path):
    from kvlab.study.experiments import ExperimentContext

    calls = []

    def fake_load(spec, **kw):
        calls.append((spec, kw["device"], kw["dtype"]))
        return f"handle of {spec}"

    monkeypatch.setattr("kvlab.model.load_model", fake_load)
    ctx = ExperimentContext(out_dir=tmp_path, model_spec="m", dtype="bfloat16", device="cuda:1")
    assert ctx.handle() == "handle of m" and ctx.handle() == "handle of m"
    ctx.load_model("other")  # a second model (a reference, a transplant target): same device and dtype
    ctx.load_model("ref", dtype="float64")
    assert calls == [
        ("m", "cuda:1", "bfloat16"),
        ("other", "cuda:1", "bfloat16"),
        ("ref", "cuda:1", "float64"),
    ]


def test_study_workers_load_their_copy_on_the_studys_device(monkeypatch, tmp_path):
    """run_study resolves the device once (auto -> cpu here) and every worker process's initializer loads
    the model with it: the pool is a stand-in whose initializer runs here."""
    from kvlab.study import runner
    from kvlab.study.experiments import Experiment, ExperimentResult

    loaded = []

    def fake_load(spec, **kw):
        loaded.append((spec, kw.get("device"), kw.get("dtype")))
        return None

    class Pool:
        def __init__(self, n, mp_context, initializer, initargs):
            initializer(*initargs)  # as each spawned worker does first

        def submit(self, fn, *args):
            import concurrent.futures as cf

            fut: cf.Future = cf.Future()
            if fn is os.getpid:
                fut.set_result(0)
            else:
                fut.set_result(fn(*args))
            return fut

        def shutdown(self, **kw):
            pass

    def run(ctx):
        return ExperimentResult(name=ctx.out_dir.name, title="x", summary={"device": ctx.device})

    exps = {n: Experiment(n, n, run, order=i) for i, n in enumerate(("a", "b"))}
    monkeypatch.setattr(runner, "registry", lambda: exps)
    monkeypatch.setattr(runner, "_WORKER", {})
    monkeypatch.setattr(runner, "_check_model", lambda *a: None)
    monkeypatch.setattr(runner.cf, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr("kvlab.model.load_model", fake_load)
    outcome = runner.run_study(
        out=tmp_path, model_spec="m", device="auto", dtype="bfloat16", workers=2, show_progress=False
    )
    here = resolve_device("auto")
    assert loaded and set(loaded) == {("m", here, "bfloat16")}
    assert {r.summary["device"] for _, r in outcome.results} == {here}
    doc = json.loads((outcome.run_dir / "a" / "result.json").read_text())
    assert doc["manifest"]["device"]["device"] == here and doc["manifest"]["device"]["dtype"] == "bfloat16"
    study = json.loads((outcome.run_dir / "result.json").read_text())
    assert study["manifest"]["device"]["device"] == here


# -- end to end on the CPU ------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_device_cpu_and_auto_run_end_to_end(capsys, tmp_path, smollm):
    """``--device cpu --dtype bfloat16`` generates; ``--device auto`` (cpu here) writes a report that says
    where it ran."""
    code = main(["generate", "The capital of France is", "-n", "3", "--device", "cpu", "--dtype", "bfloat16"])
    out = capsys.readouterr()
    assert code == 0 and out.out.strip(), out.err
    code = main(["inspect", "--quick", "--json", "-p", "Hello", "--device", "auto", "--out", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["manifest"]["device"]["device"] == resolve_device("auto")
    assert doc["manifest"]["device"]["dtype"] == "float32"
    page = (Path(doc["report_dir"]) / "index.html").read_text()
    assert f"{resolve_device('auto')} float32" in page
