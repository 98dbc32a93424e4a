"""Progress of ``kvlab study`` (k of n, elapsed, an estimate; one line per experiment off a terminal, nothing
with --json), the helper behind it (``kvlab.progress``), and ``kvlab study --resume DIR``."""

from __future__ import annotations

import io
import json

import pytest

from kvlab.errors import BadInputError
from kvlab.progress import Estimate, counting, duration
from kvlab.study import runner
from kvlab.study.experiments import Experiment, ExperimentResult
from tests.test_eval_tasks import WordTokenizer


def test_duration_and_the_estimate():
    assert [duration(s) for s in (0.44, 12.34, 100, 3725)] == ["0.4 s", "12.3 s", "1 min 40 s", "1 h 02 min"]
    typical = Estimate({"a": 10, "b": 20, "c": 30}, seconds=True)
    assert typical.left({}, ["a", "b", "c"]) == 60  # the table as it is, before anything finished
    assert typical.left({"a": 20.0}, ["b", "c"]) == 100  # a took twice its entry: so will the rest
    assert Estimate({"a": 10, "b": 20, "c": 30}, seconds=True, parallel=2).left({"a": 20.0}, ["b", "c"]) == 60
    assert typical.left({"a": 20.0}, ["b", "x"]) == 60  # x has no entry: it counts as the mean finished one
    relative = Estimate({"a": 100, "b": 300})  # tokens, not seconds: no estimate until one finished
    assert relative.left({}, ["a", "b"]) is None and relative.left({"a": 2.0}, ["b"]) == 6
    assert Estimate().left({}, []) == 0.0 and typical.left({}, ["x"]) is None  # nothing known yet


def test_the_counter_on_a_terminal_and_off_one():
    from rich.console import Console

    screen = io.StringIO()
    with counting("cells", ["a", "b"], mode="rich", console=Console(file=screen, force_terminal=True)) as c:
        c.done("a", 1.0)
        c.done("b", 2.0, status="failed")
    assert "2/2" in screen.getvalue() and "[2/2] b failed 2.0 s" in screen.getvalue()
    log = io.StringIO()
    with counting("cells", ["a", "b"], mode="plain", console=Console(file=log), finished={"a": 3.0}) as c:
        c.done("b", 3.0)
    assert log.getvalue().splitlines() == ["cells: 2 (1 already done)", "[2/2] b ok 3.0 s · done in 0.0 s"]
    quiet = io.StringIO()
    with counting("cells", ["a"], mode="off", console=Console(file=quiet)) as c:
        c.done("a", 1.0)
    assert quiet.getvalue() == ""


CALLS: list[str] = []


def _exp(name: str, *, fail: bool = False, interrupt: bool = False) -> Experiment:
    def run(ctx):
        CALLS.append(name)
        if interrupt:
            raise KeyboardInterrupt
        if fail:
            raise RuntimeError("broken")
        return ExperimentResult(name=name, title=name.title(), summary={"v": len(name)}, notes=["n"])

    return Experiment(name, name.title(), run, order=len(CALLS))


@pytest.fixture
def study(tiny_llama_2x64, monkeypatch):
    """``kvlab study`` over made-up experiments (``study.set(...)``) on the tiny random model."""
    from kvlab.model.handle import ModelHandle

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    monkeypatch.setattr("kvlab.model.load_model", lambda *a, **k: handle)
    exps: dict[str, Experiment] = {}
    monkeypatch.setattr(runner, "registry", lambda: exps)
    CALLS.clear()

    class Study:
        def set(self, *experiments: Experiment) -> None:
            exps.clear()
            exps.update({e.name: e for e in experiments})

        def __call__(self, capsys, *args: str):
            from kvlab.cli import main

            code = main(["study", "--quick", "--workers", "1", "--device", "cpu", *args])
            out = capsys.readouterr()
            return code, out.out, out.err

    return Study()


def test_study_progress_lines_and_json_silence(study, tmp_path, capsys):
    study.set(_exp("alpha"), _exp("beta"))
    code, out, err = study(capsys, "--out", str(tmp_path))
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[0] == "study: 2 experiments, profile quick"  # no timing known for made-up experiments
    assert (
        lines[1].startswith("[1/2] alpha ok ") and "elapsed · ETA ~" in lines[1] and "(estimate)" in lines[1]
    )
    assert lines[2].startswith("[2/2] beta ok ") and "done in" in lines[2] and len(lines) == 3
    code, out, err = study(capsys, "--out", str(tmp_path), "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc["summary"]["seconds"]) == {"alpha", "beta"} and doc["report_dir"].startswith(str(tmp_path))
    # a third run in the same folder estimates from the earlier run (this machine's own timings)
    code, _, err = study(capsys, "--out", str(tmp_path))
    assert "ETA ~" in err.splitlines()[0] and "estimate from the earlier run study-" in err.splitlines()[0]


def test_an_interrupted_study_resumes(study, tmp_path, capsys):
    study.set(_exp("alpha"), _exp("beta", interrupt=True), _exp("gamma", fail=True))
    code, _, err = study(capsys, "--out", str(tmp_path))
    assert code == 130 and CALLS == ["alpha", "beta"]
    (folder,) = tmp_path.glob("study-*")
    assert json.loads((folder / "alpha" / "result.json").read_text())["status"] == "ok"
    assert not (folder / "index.html").exists()  # the report comes with the end of the study

    code, _, err = study(capsys, "--resume", str(folder), "--seed", "3")
    assert code == 2 and "seed (--seed) 0" in err and len(err.strip().splitlines()) == 1
    code, _, err = study(capsys, "--resume", str(folder), "--dtype", "float16")
    assert code == 2 and "dtype (--dtype) float32, this command asks for float16" in err
    code, _, err = study(capsys, "--resume", str(tmp_path))
    assert code == 2 and "not a study folder" in err
    with pytest.raises(
        BadInputError, match=r"experiments \(--only\) alpha,beta,gamma, this command asks for alpha;"
    ):
        runner.run_study(resume=folder, only=["alpha"], profile="quick", show_progress=False)
    assert CALLS == ["alpha", "beta"]  # refusals ran nothing

    study.set(_exp("alpha"), _exp("beta"), _exp("gamma", fail=True))
    code, _, err = study(capsys, "--resume", str(folder))
    assert code == 1 and CALLS == ["alpha", "beta", "beta", "gamma"]  # alpha was kept, not run again
    assert "(1 already done)" in err and "[3/3] gamma failed" in err
    assert "alpha" in (folder / "index.html").read_text()
    summary = json.loads((folder / "result.json").read_text())["summary"]
    assert summary["resumed"] == ["alpha"] and summary["failed"] == ["gamma"]

    study.set(_exp("alpha"), _exp("beta"), _exp("gamma"))
    code, _, err = study(capsys, "--resume", str(folder))  # the failed section runs again
    assert code == 0 and CALLS[-1] == "gamma" and CALLS.count("alpha") == 1
    assert json.loads((folder / "gamma" / "result.json").read_text())["status"] == "ok"


def test_sweep_cells_count_and_estimate_from_the_typical_timings(tmp_path, capsys):
    from kvlab.study.sweep.grid import Cell
    from kvlab.study.sweep.run import _cell_counter

    names = ["inspect", "roll_long", "compaction"]  # quick profile: 4.3, 27.6 and 25.3 s typically
    cells = [Cell("tiny:x.json", e, {}, 0, None, "quick", key=f"{i}" * 16) for i, e in enumerate(names)]
    (tmp_path / "cells" / cells[0].folder_name).mkdir(parents=True)
    (tmp_path / "cells" / cells[0].folder_name / "cell.json").write_text('{"seconds": 8.6}')  # a resumed cell
    with _cell_counter(cells, cells[1:], "plain", 1, tmp_path) as counter:
        counter.done(cells[1].key, 55.2, "ok", label="x roll_long seed 0")
    lines = capsys.readouterr().err.splitlines()
    # inspect took twice its typical time, so the rest is expected at twice theirs: 55.2 + 50.6 s
    assert lines[0] == "sweep: 3 cells (1 already done) · ETA ~1 min 46 s (estimate)"
    assert lines[1].startswith("[2/3] x roll_long seed 0 ok 55.2 s · ") and lines[1].endswith(
        "ETA ~50.6 s (estimate)"
    )


def test_an_experiments_own_tasks_off_a_terminal_and_quiet(capsys):
    """What an experiment command's loops (``kvlab stream-ppl``'s windows) show when stderr is no terminal."""
    with runner.progress_display(True) as progress:
        with progress.task("stream-ppl W=64", total=3) as advance:
            for _ in range(3):
                advance(1)
        progress.log("a note")
    lines = capsys.readouterr().err.splitlines()
    assert (
        lines[0].startswith("stream-ppl W=64: 3/3 in ") and lines[0].endswith(" s") and lines[1] == "a note"
    )
    with runner.progress_display(False) as progress, progress.task("quiet", total=2) as advance:
        advance(2)
        progress.log("not shown")
    assert capsys.readouterr().err == ""
