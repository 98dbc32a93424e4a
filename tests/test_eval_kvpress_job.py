"""benchmarks/eval_ruler.py: the kvpress job carries exactly the ids kvlab ran, and the merge scores with kvlab's scorer.

A tiny random Llama with a word tokenizer (no kvpress, no real model): run_suite runs through the
benchmark's recorder, the job lines are compared with ids derived independently (the seeded trial,
encoded; the full cache's greedy answer recomputed), and hand-made worker rows are merged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvlab.eval.specs import parse_cache_specs
from kvlab.eval.tasks import encoder, make_trial, trial_seed
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_ruler  # noqa: E402


class AnswerTokenizer(WordTokenizer):
    """WordTokenizer whose ids >= 600 (outside the model's vocabulary) decode to chosen strings."""

    def __init__(self) -> None:
        self.words: dict[int, str] = {}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(self.words.get(int(i), f"w{int(i)}") for i in ids)


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_llama_2x64.model, AnswerTokenizer(), name="tiny-llama")


def _run_kvlab(tiny, out: Path, trials: int, first: int = 0) -> tuple[list[dict], list[dict]]:
    """The benchmark's recorder over 2 tasks x ``trials`` trials from ``first`` (job lines in ``out``)."""
    specs = parse_cache_specs(["full", "snapkv:0.5", "window:0.25", "int4"])
    rows, records = eval_ruler.run_kvlab(
        tiny,
        specs,
        tasks=["niah_single", "vt"],
        lengths=[200],
        trials=trials,
        seed=3,
        first_trial=first,
        trials_file=out / "trials.jsonl",
        haystack_text=HAYSTACK,
        max_new_tokens=5,
    )
    eval_ruler.end_job(out / "trials.jsonl")
    return rows, records


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ruler")
    rows, records = _run_kvlab(tiny, out, 2)
    return rows, records, out / "trials.jsonl"


def test_the_job_carries_the_ids_kvlab_ran(tiny, run):
    from tests.layers_ref import greedy_after_layers

    rows, records, path = run
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-1] == {"end": True}
    jobs = lines[:-1]
    assert len(jobs) == len(records) == 4
    assert not any("answers" in j or "rule" in j for j in jobs)  # scoring stays in kvlab's process
    encode = encoder(tiny)
    for job in jobs:
        trial = make_trial(job["task"], tiny, 200, trial_seed(3, job["trial"]), HAYSTACK)
        assert job["seed"] == trial.seed
        assert job["context"] == encode(trial.context)
        assert job["question"] == encode(trial.question)
        snap = tiny.prefill(job["context"], all_logits=False).snapshot
        answer = greedy_after_layers(tiny, snap.keys, snap.values, job["question"], len(job["context"]), 5)
        stops = [i for i, t in enumerate(answer) if t in tiny.eos_ids()]
        answer = answer[: stops[0] + 1] if stops else answer  # the answer ends with its stop token
        assert job["answer"] == answer and job["max_new_tokens"] == 5
        assert len(job["kvlab_full_argmax"]) == len(job["question"]) + len(answer) - 1
    # every kvlab row belongs to a recorded trial, and the recorder left the handle as it was
    assert {(r["task"], r["trial"]) for r in rows} == {(j["task"], j["trial"]) for j in jobs}
    assert "prefill" not in vars(tiny)


def test_the_merge_scores_with_kvlabs_scorer(tiny, run):
    _, records, _ = run
    rec = next(r for r in records if r["task"] == "niah_single")
    tiny.tokenizer.words.update({600: f"is {rec['answers'][0]}.", 601: "is 0000000."})
    eos = min(tiny.eos_ids())

    def worker_row(setup, press, ratio, ids):
        return {
            "key": rec["key"],
            "task": rec["task"],
            "length": rec["length"],
            "trial": rec["trial"],
            "seed": rec["seed"],
            "setup": setup,
            "press": press,
            "ratio": ratio,
            "answer_ids": ids,
            "kept_slots": 10,
            "kv_bytes": 100,
            "kld": 0.5,
            "top1": 0.9,
            "kld_answer": 0.4,
            "top1_answer": 0.8,
            "compared_tokens": 7,
            "prefill_s": 0.1,
            "seconds": 0.2,
        }

    merged, failed = eval_ruler.merge(
        tiny,
        records,
        [
            {"meta": True},
            worker_row("full", None, 0.0, [600, eos, 601]),  # right, then the stop id: cut there
            worker_row("snapkv:0.5", "snapkv", 0.5, [601]),  # wrong
            {**worker_row("knorm:0.5", "knorm", 0.5, []), "error": "boom"},
            {"done": True},
        ],
    )
    assert [r["score"] for r in merged] == [1.0, 0.0]
    assert merged[0]["output"] == f"is {rec['answers'][0]}." and merged[0]["kind"] == "full"
    assert merged[1]["spec"] == "kvpress snapkv:0.5" and merged[1]["compression_ratio"] == 0.5
    assert [w["setup"] for w in failed] == ["knorm:0.5"]
    summary = eval_ruler.summary_rows(merged, seed=0)
    assert {s["name"] for s in summary} == {"full", "snapkv"}


HAY = eval_ruler.haystack_facts(type("Text", (), {"text": HAYSTACK, "source": "haystack.txt"})())
MACHINE = {"arch": "x86_64", "cpus": 16, "device": "CUDA (a card)", "torch": "2.11", "transformers": "5.24"}


def _piece(
    tiny, out: Path, first: int, trials: int, argv: list[str], haystack: dict = HAY, machine: dict = MACHINE
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows, records = _run_kvlab(tiny, out, trials, first)
    doc = {"rows": rows, "records": records, "kvlab_seconds": 1.0, "started": 0.0, "load_before": [0, 0, 0]}
    doc |= {"machine": machine, "haystack": haystack}  # recorded by the run: where, and over which text
    (out / "kvlab.json").write_text(json.dumps({**doc, "argv": argv}))
    (out / "job.json").write_text("{}")


def test_a_run_in_pieces_equals_the_run(tiny, run, tmp_path):
    """Trials 0 and 1 run as two pieces (--first-trial) give the whole run's rows, and the merge refuses
    overlapping pieces and pieces of different arguments."""
    base = ["--no-kvpress", "--lengths", "200", "--seed", "3"]
    _piece(tiny, tmp_path / "a", 0, 1, [*base, "--trials", "1"])
    _piece(tiny, tmp_path / "b", 1, 1, [*base, "--trials", "1", "--first-trial", "1"])
    eval_ruler.pieces([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    merged = json.loads((tmp_path / "m" / "kvlab.json").read_text())
    key = lambda r: (r["task"], r["trial"], r["spec"])  # noqa: E731
    whole = {key(r): (r["output"], r["score"], r.get("kl_mean")) for r in run[0]}
    assert {key(r): (r["output"], r["score"], r.get("kl_mean")) for r in merged["rows"]} == whole
    assert sorted(r["key"] for r in merged["records"]) == sorted(r["key"] for r in run[1])
    assert "--first-trial" not in merged["argv"] and merged["argv"][-2:] == ["--trials", "2"]
    # the report of the merged run names the pieces' machine and haystack, not the merging process's
    assert merged["machine"] == MACHINE and merged["haystack"] == HAY
    assert HAY["source"] == "haystack.txt" and HAY["chars"] == len(HAYSTACK) and len(HAY["sha256"]) == 16
    with pytest.raises(SystemExit, match="overlap"):
        eval_ruler.pieces([tmp_path / "a", tmp_path / "a"], tmp_path / "x")
    _piece(tiny, tmp_path / "c", 1, 1, [*base, "--trials", "1", "--first-trial", "1", "--ratios", "0.5"])
    with pytest.raises(SystemExit, match="different arguments"):
        eval_ruler.pieces([tmp_path / "a", tmp_path / "c"], tmp_path / "y")
    other = {**HAY, "source": "other.txt", "sha256": "0" * 16}
    _piece(tiny, tmp_path / "d", 1, 1, [*base, "--trials", "1", "--first-trial", "1"], haystack=other)
    with pytest.raises(SystemExit, match="different haystacks"):
        eval_ruler.pieces([tmp_path / "a", tmp_path / "d"], tmp_path / "z")
    # a piece from a GPU beside one from this CPU: the same run (device, threads and the haystack's path
    # may differ; its text may not), the merged machine naming each device and its trials
    gpu = {**MACHINE, "device": "CUDA (NVIDIA H100 80GB HBM3)", "cpus": 32}
    elsewhere = [*base, "--trials", "1", "--first-trial", "1", "--device", "cuda", "--threads", "4"]
    _piece(tiny, tmp_path / "g", 1, 1, [*elsewhere, "--haystack", "/elsewhere/haystack.txt"], machine=gpu)
    eval_ruler.pieces([tmp_path / "a", tmp_path / "g"], tmp_path / "mixed")
    mixed = json.loads((tmp_path / "mixed" / "kvlab.json").read_text())["machine"]
    assert mixed["mixed"] and mixed["cpus"] == f"{MACHINE['cpus']} / 32"
    assert mixed["device"] == (
        f"{MACHINE['device']} ({MACHINE['cpus']} CPU cores, 1 torch thread(s)) for 1 trials per task; "
        "CUDA (NVIDIA H100 80GB HBM3) (32 CPU cores, 4 torch thread(s)) for 1 trials per task"
    )


def test_an_archived_run_is_a_piece(tiny, tmp_path):
    """A merged run kept as gzipped raw rows (--archive: what benchmarks/results/raw/ holds) merges with a
    later piece exactly as the plain pieces do, and a second archive of the same run is byte-identical."""
    base = ["--no-kvpress", "--lengths", "200", "--seed", "3"]
    _piece(tiny, tmp_path / "a", 0, 1, [*base, "--trials", "1"])
    _piece(tiny, tmp_path / "b", 1, 1, [*base, "--trials", "1", "--first-trial", "1"])
    (tmp_path / "b" / "kvpress.jsonl").write_text('{"meta": true}\n{"trial": 1, "spec": "kvpress x"}\n')
    eval_ruler.pieces([tmp_path / "a"], tmp_path / "m")
    written = eval_ruler.archive(tmp_path / "m", tmp_path / "raw")
    assert sorted(p.name for p in written) == ["job.json.gz", "kvlab.json.gz", "kvpress.jsonl.gz"]
    assert not (tmp_path / "raw" / "kvlab.json").exists()
    again = eval_ruler.archive(tmp_path / "m", tmp_path / "raw2")
    assert [p.read_bytes() for p in written] == [p.read_bytes() for p in again]
    eval_ruler.pieces([tmp_path / "raw", tmp_path / "b"], tmp_path / "from_archive")
    eval_ruler.pieces([tmp_path / "a", tmp_path / "b"], tmp_path / "from_pieces")
    got, want = (
        json.loads((tmp_path / d / "kvlab.json").read_text()) for d in ("from_archive", "from_pieces")
    )
    drop = ("pieces",)  # which folders the rows came from differs; nothing else may
    assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}
    assert eval_ruler.read_jsonl(tmp_path / "from_archive" / "kvpress.jsonl") == eval_ruler.read_jsonl(
        tmp_path / "from_pieces" / "kvpress.jsonl"
    )
    with pytest.raises(SystemExit, match="overlap"):  # the archive already holds trial 0
        eval_ruler.pieces([tmp_path / "raw", tmp_path / "a"], tmp_path / "x")


@pytest.mark.process
def test_a_refused_command_line_is_one_line_and_exit_2(tmp_path):
    """Bad arguments stop the script before it writes anything: one line on stderr, status 2."""
    import subprocess

    script = Path(eval_ruler.__file__)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(script), "--merge", str(tmp_path), "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip()
        == "error: --merge and --archive report pieces that ran: give them with --report-only"
    )
    assert not out.exists()


def test_a_model_kvpress_cannot_run_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """A text-only Gemma-3 (kvpress compresses its sliding layers and the next forward fails) is refused in
    one line unless --no-kvpress, before the model loads or anything is written; the multimodal Gemma-3
    (kvpress skips its sliding layers) and the bundled Llama are not."""
    from tests.conftest import config_path

    gemma = json.loads(config_path("gemma3").read_text())
    assert "give --no-kvpress" in eval_ruler.kvpress_cannot_run(gemma)
    assert eval_ruler.kvpress_cannot_run({"model_type": "gemma3", "text_config": gemma}) is None
    assert eval_ruler.kvpress_cannot_run(json.loads(config_path("llama").read_text())) is None
    assert "give --no-kvpress" in eval_ruler.kvpress_refusal("gemma3-270m")  # the alias: nothing converted
    assert eval_ruler.kvpress_refusal("smollm2-135m") is None

    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(gemma))  # no weights: the refusal comes first
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    out = tmp_path / "out"
    with pytest.raises(eval_ruler.Refusal, match="does not run a text-only Gemma-3"):
        eval_ruler.main(["--model", str(folder), "--trials", "1", "--out-dir", str(out)])
    assert not out.exists()
