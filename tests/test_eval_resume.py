"""``kvlab eval ruler``: progress on stderr (one line per trial off a terminal, nothing with --json), each
trial kept as it finishes, and ``--resume DIR`` finishing an interrupted run to the uninterrupted result."""

from __future__ import annotations

import json

import pytest

from kvlab.eval import run as eval_run
from kvlab.eval.resume import PARTIAL
from tests.test_eval_tasks import WordTokenizer

ARGS = [
    "--cache", "full", "--cache", "snapkv:0.5", "--tasks", "niah_single,vt", "--lengths", "160",
    "--trials", "3", "--max-new-tokens", "3", "--device", "cpu",
]  # fmt: skip
TIMINGS = ("seconds", "prefill_s")
RUN_TRIAL = eval_run.run_trial


@pytest.fixture
def tiny(tiny_llama_2x64, monkeypatch):
    """The tiny random Llama with a word tokenizer, as ``kvlab.load_model`` returns it to the command."""
    import kvlab
    from kvlab.model.handle import ModelHandle

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: handle)
    return handle


def _cli(capsys, *args):
    from kvlab.cli import main

    code = main(["eval", "ruler", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _untimed(doc: dict) -> dict:
    """The document without what differs between any two runs: the timings."""
    return {
        "settings": doc["settings"],
        "summary": [{k: v for k, v in s.items() if k != "seconds"} for s in doc["summary"]],
        "rows": [{k: v for k, v in r.items() if k not in TIMINGS} for r in doc["rows"]],
    }


def _counting_trials(monkeypatch, stop_after: int | None = None) -> list[str]:
    """Record each trial run_trial runs; raise KeyboardInterrupt (as ctrl-C would) at trial ``stop_after``."""
    real, ran = RUN_TRIAL, []

    def counted(handle, trial, *a, **k):
        if stop_after is not None and len(ran) == stop_after:
            raise KeyboardInterrupt
        ran.append(f"{trial.task} {trial.seed}")
        return real(handle, trial, *a, **k)

    monkeypatch.setattr(eval_run, "run_trial", counted)
    return ran


def test_progress_lines_off_a_terminal_and_silence_with_json(tiny, tmp_path, capsys):
    code, out, err = _cli(capsys, *ARGS)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("ruler: 6 trials (2 tasks x 1 lengths x 3), each under 2 caches")
    trial_lines = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in trial_lines] == [f"[{k}/6" for k in range(1, 7)]
    assert "niah_single 160 #0 ok" in trial_lines[0] and "ETA ~" in trial_lines[0]
    assert "done in" in trial_lines[-1] and "| niah_single | 160 | full | 3 |" in out
    code, out, err = _cli(capsys, *ARGS, "--json")
    assert code == 0 and err == "" and len(json.loads(out)["rows"]) == 12


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tiny, tmp_path, monkeypatch, capsys):
    whole, part = tmp_path / "whole", tmp_path / "part"
    code, out, err = _cli(capsys, *ARGS, "--out", str(whole), "--json")
    assert code == 0, err
    assert not (whole / PARTIAL).exists()  # a finished run leaves ruler.json only
    expected = json.loads((whole / "ruler.json").read_text())

    ran = _counting_trials(monkeypatch, stop_after=4)
    code, _, err = _cli(capsys, *ARGS, "--out", str(part))
    assert code == 130 and f"--resume {part}" in err and "4 finished trials kept" in err, err
    assert not (part / "ruler.json").exists() and len(ran) == 4
    kept = (part / PARTIAL).read_text().splitlines()
    assert len(kept) == 5 and "settings" in json.loads(kept[0])  # the settings, then one line per trial
    with (part / PARTIAL).open("a") as f:
        f.write('{"task": "vt", "length": 160, "tri')  # a line cut short by the interruption

    code, _, err = _cli(capsys, *ARGS, "--out", str(part))  # a fresh run would drop the kept trials
    assert code == 2 and "unfinished run" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, *ARGS, "--seed", "1", "--resume", str(part))
    assert code == 2 and "seed 0" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, *ARGS, "--resume", str(tmp_path / "nothing"))
    assert code == 2 and "no unfinished run" in err

    ran = _counting_trials(monkeypatch)
    code, _, err = _cli(capsys, *ARGS, "--resume", str(part))
    assert code == 0, err
    assert len(ran) == 2 and "(4 already done)" in err  # only the two missing trials ran
    resumed = json.loads((part / "ruler.json").read_text())
    assert _untimed(resumed) == _untimed(expected)
    assert not (part / PARTIAL).exists()
    code, _, err = _cli(capsys, *ARGS, "--resume", str(part))
    assert code == 2 and "finished" in err
