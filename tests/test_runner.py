"""The report plumbing: result.json + arrays.npz + index.html, and a study that survives a failing experiment."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import numpy as np
import pytest

from kvlab.errors import BadInputError
from kvlab.study import experiments, runner
from kvlab.study.experiments import Experiment, ExperimentContext, ExperimentResult, Table, needed


def good(ctx: ExperimentContext) -> ExperimentResult:
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    return ExperimentResult(
        name="good",
        title="A good experiment",
        summary={"answer": 42, "curve": list(range(20)), "nan": float("nan")},
        tables=[Table("t", ["a", "b"], [[1, 2.5]])],
        figures=[ctx.figure("line", fig, "a line")],
        arrays={"raw": np.arange(12).reshape(3, 4)},
        notes=[f"profile {ctx.profile}"],
    )


def bad(ctx: ExperimentContext) -> ExperimentResult:
    raise BadInputError("this experiment cannot run here")


@pytest.fixture
def fake_registry(monkeypatch):
    exps = {
        "good": Experiment("good", "A good experiment", good, order=1),
        "bad": Experiment("bad", "A failing experiment", bad, order=2),
    }
    monkeypatch.setattr(runner, "registry", lambda: exps)
    # what `kvlab study --only` checks names against, without importing the experiments
    monkeypatch.setattr(experiments, "CATALOGUE", {n: (e.title, e.in_study) for n, e in exps.items()})
    return exps


@pytest.mark.real_model  # the study checks the bundled model before it runs
def test_study_writes_every_section_and_survives_a_failure(tmp_path, fake_registry):
    outcome = runner.run_study(out=tmp_path, profile="quick", show_progress=False)
    assert outcome.failed == ["bad"]
    root = outcome.run_dir
    index = (root / "index.html").read_text()
    assert "good/line.png" in index and "A failing experiment" in index and "cannot run here" in index
    doc = json.loads((root / "good" / "result.json").read_text())
    assert doc["summary"]["answer"] == 42 and doc["summary"]["nan"] is None  # strict JSON
    assert doc["manifest"]["profile"] == "quick" and "torch" in doc["manifest"]["versions"]
    assert np.load(root / "good" / doc["arrays"]["file"])["raw"].shape == (3, 4)
    assert (root / "good" / "line.png").stat().st_size > 1000
    bad_doc = json.loads((root / "bad" / "result.json").read_text())
    assert bad_doc["status"] == "failed"


def test_unknown_profile_and_experiment(tmp_path, fake_registry):
    with pytest.raises(BadInputError):
        ExperimentContext(out_dir=tmp_path, profile="huge")
    with pytest.raises(BadInputError, match="unknown experiment"):
        runner.run_study(out=tmp_path, only=["nope"], show_progress=False)


@pytest.mark.real_model
def test_cli_study_exits_1_when_an_experiment_failed(tmp_path, fake_registry, capsys):
    from kvlab.cli import main

    assert main(["study", "--quick", "--only", "bad", "--out", str(tmp_path)]) == 1
    assert main(["study", "--quick", "--only", "good", "--out", str(tmp_path)]) == 0


def test_study_with_an_unknown_model_is_one_error_and_writes_nothing(tmp_path):
    from kvlab.errors import ModelNotFoundError
    from kvlab.study.runner import run_study

    with pytest.raises(ModelNotFoundError, match="never downloads"):
        run_study(out=tmp_path / "runs", model_spec="no-such-org/no-such-model", profile="quick")
    assert not (tmp_path / "runs").exists()


def test_declared_dependencies_run_first_and_are_handed_over(tmp_path, monkeypatch):
    """An experiment that ``needs`` another gets its summary from the study, never from its files."""
    seen: dict[str, object] = {}

    def base_run(ctx):
        return ExperimentResult(name="base_x", title="base", summary={"value": 7})

    def user_run(ctx):
        seen["summary"], seen["how"] = needed(ctx, "base_x")
        return ExperimentResult(name="user_x", title="user", summary={"twice": 2 * seen["summary"]["value"]})

    base = Experiment(name="base_x", title="base", run=base_run, order=900)
    user = Experiment(name="user_x", title="user", run=user_run, order=10, needs=("base_x",))
    assert [e.name for e in runner.dependencies_first([user, base])] == ["base_x", "user_x"]
    cyc_a = Experiment(name="a", title="a", run=base_run, needs=("b",))
    cyc_b = Experiment(name="b", title="b", run=base_run, needs=("a",))
    with pytest.raises(BadInputError, match="cycle"):
        runner.dependencies_first([cyc_a, cyc_b])
    # run alone, the needed experiment is computed in a sub-folder
    monkeypatch.setattr("kvlab.study.experiments.get_experiment", lambda name: {"base_x": base}[name])
    ctx = ExperimentContext(out_dir=tmp_path / "user_x", profile="quick", model_handle=object())
    assert user.run(ctx).summary == {"twice": 14} and seen["how"].startswith("computed here")
    ctx = ExperimentContext(out_dir=tmp_path / "u2", profile="quick", upstream={"base_x": {"value": 1}})
    assert user.run(ctx).summary == {"twice": 2} and "this study" in str(seen["how"])


# -- a study on several workers ------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.process  # a pool of worker processes
def test_parallel_study_runs_real_experiments_in_worker_processes(tmp_path):
    """Two worker processes (spawned, each with its own model copy): every section is written, in study
    order, and a deterministic experiment reports what it reports when run in this process."""
    only = ["inspect", "transplant", "layer_transfer"]
    par = runner.run_study(out=tmp_path / "par", profile="quick", only=only, show_progress=False, workers=2)
    assert par.failed == [] and [n for n, _ in par.results] == ["inspect", "layer_transfer", "transplant"]
    study = json.loads((par.run_dir / "result.json").read_text())
    assert study["summary"]["workers"] == 2 and set(study["summary"]["seconds"]) == set(only)
    for name in only:
        assert json.loads((par.run_dir / name / "result.json").read_text())["status"] == "ok"
        assert (par.run_dir / name / "index.html").is_file()
    one = runner.run_study(out=tmp_path / "one", profile="quick", only=["inspect"], show_progress=False)
    a, b = dict(par.results)["inspect"].summary, dict(one.results)["inspect"].summary
    assert a["measured_bytes_per_token"] == b["measured_bytes_per_token"] and a.keys() == b.keys()


class _ThreadWorkers:
    """Stands in for runner._Workers with threads, so the scheduling runs on fake experiments."""

    def __init__(self, n: int) -> None:
        import concurrent.futures as cf
        import queue

        self.n, self.queue, self.restarts = n, queue.Queue(), 0
        self.pool = cf.ThreadPoolExecutor(n)

    def restart(self) -> None:
        # A broken process pool's workers are gone before the new pool starts (the executor terminates
        # them); threads cannot be killed, so wait for the old ones instead: otherwise a chain re-run on
        # the new pool could write the same section folder as its orphaned first run, at the same time.
        import concurrent.futures as cf

        self.restarts += 1
        self.pool.shutdown(wait=True)
        self.pool = cf.ThreadPoolExecutor(self.n)

    def close(self) -> None:
        pass


def test_parallel_scheduling_respects_needs_reuse_chains_and_a_dead_worker(tmp_path, monkeypatch):
    import concurrent.futures as cf
    import threading
    from concurrent.futures.process import BrokenProcessPool

    order: list[str] = []
    where: list[tuple[int, str]] = []  # (thread, experiment) in run order
    lock = threading.Lock()

    def make(name: str):
        def run(ctx):
            with lock:
                order.append(name)
                where.append((threading.get_ident(), name))
            return ExperimentResult(
                name=name, title=name, summary={"v": len(name), "up": sorted(ctx.upstream)}
            )

        return run

    exps = [
        Experiment("a", "a", make("a"), order=1),
        Experiment("memo_user", "memo_user", make("memo_user"), order=2, reuses="a"),
        Experiment("b", "b", make("b"), order=3),
        Experiment("dies", "dies", make("dies"), order=4),
        Experiment("last", "last", make("last"), order=5, needs=("a", "b", "memo_user")),
    ]
    reg = {e.name: e for e in exps}
    monkeypatch.setattr(runner, "registry", lambda: reg)
    workers = _ThreadWorkers(2)
    monkeypatch.setitem(runner._WORKER, "model", None)
    monkeypatch.setitem(runner._WORKER, "queue", workers.queue)
    real_submit = workers.pool.submit

    def submit(fn, tasks, settings):
        if tasks[0][0] == "dies":  # as if the process running it was killed
            fut: cf.Future = cf.Future()
            fut.set_exception(BrokenProcessPool("killed"))
            return fut
        return real_submit(fn, tasks, settings)

    monkeypatch.setattr(workers.pool, "submit", submit)
    settings = {"profile": "quick", "seed": 0, "model_spec": "smollm2-135m", "dtype": "float32"}
    assert [[e.name for e in c] for c in runner._chains(runner.dependencies_first(exps))] == [
        ["a", "memo_user"],
        ["b"],
        ["dies"],
        ["last"],
    ]
    got = dict(
        runner._run_parallel(
            runner.dependencies_first(exps), tmp_path, settings, workers, runner.Progress(None)
        )
    )
    thread = next(t for t, n in reversed(where) if n == "a")
    mine = [n for t, n in where if t == thread]
    assert mine[mine.index("memo_user") - 1] == "a"  # same worker, right after
    # chains running when the pool broke are run again (a real broken pool loses them), at most once more
    assert "dies" not in order and all(order.count(n) in (1, 2) for n in ("a", "b", "memo_user", "last"))
    assert order[-1] == "last" and got["last"][0].summary["up"] == ["a", "b", "memo_user"]
    assert got["dies"][2] is True and "worker process" in got["dies"][0].notes[0]
    assert json.loads((tmp_path / "dies" / "result.json").read_text())["status"] == "failed"
    assert workers.restarts == 1 and not any(got[n][2] for n in ("a", "b", "memo_user", "last"))


def test_workers_must_be_positive(tmp_path, fake_registry):
    with pytest.raises(BadInputError, match="workers"):
        runner.run_study(out=tmp_path, profile="quick", show_progress=False, workers=0)
