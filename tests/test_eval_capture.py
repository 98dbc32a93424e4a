"""``kvlab eval --capture``: a sinks + window cache answers through the captured step ``kvlab serve
--capture`` runs (``torch.compile`` on the CPU), and scores what the live batch scores: the same answer, the
same logits on the question and the full cache's answer (within 1e-5), the same row but for ``runtime``."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.eval.captured import CapturedAnswers
from kvlab.eval.run import run_trial
from kvlab.eval.specs import parse_cache_specs
from kvlab.eval.tasks import encoder, make_trial
from kvlab.model.handle import ModelHandle
from kvlab.policy.evict import observe
from tests.test_eval_tasks import HAYSTACK, WordTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = "sinks=4,window=48"


@pytest.fixture(scope="module")
def handle(tiny_llama_2x64):
    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


@pytest.fixture(scope="module")
def captured(handle):
    return CapturedAnswers(handle, "compile")


def _rolled(handle, trial, spec=WINDOW):
    """The context as ``spec``'s cache holds it (the eval's offline application), its window, the question."""
    encode = encoder(handle)
    policy = parse_cache_specs([spec])[0].policy
    snap = policy.layout.apply(policy, observe(handle, encode(trial.context)), handle)[0]
    return snap, policy.capturable(), encode(trial.question)


def _live(handle, snap, question, n_new, reference):
    """What the eval's live batch gives: the greedy answer, the logits on question + reference[:-1]."""
    stop = handle.eos_ids()
    with handle.live_rows([snap], room=len(question) + n_new, start=snap.next_position) as live:
        asked = live.feed(question)
        answer = live.greedy(asked[:, -1], n_new, stop_ids=stop)[0]
        live.rewind(len(question))
        tail = [live.feed(reference[:-1])] if len(reference) > 1 else []
    return answer, torch.cat([asked, *tail], dim=1)[0]


@pytest.mark.parametrize("forced", ["own", "other"])
def test_a_captured_answer_equals_the_live_batch(handle, captured, forced):
    trial = make_trial("niah_single", handle, 160, 3, HAYSTACK)
    snap, roll, question = _rolled(handle, trial)
    assert snap.seq_len < snap.next_position  # rolled: the sinks and the window, at their live positions
    n_new = 6
    own, _ = _live(handle, snap, question, n_new, [0])
    # the full cache's answer (forced) is the window's own (its logits come from the greedy pass), or another
    reference = own if forced == "own" else [t + 1 for t in own]
    want_answer, want = _live(handle, snap, question, n_new, reference)
    answer, got = captured.answer(roll, snap, question, n_new, handle.eos_ids(), reference)
    assert answer == want_answer == own
    assert got.shape == want.shape == (len(question) + len(reference) - 1, want.shape[-1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rows_are_built_once_and_wider_only_when_a_trial_needs_room(handle, monkeypatch):
    import kvlab.eval.captured as mod

    monkeypatch.setattr(mod, "ROOM", 8)
    cap = CapturedAnswers(handle, "compile")
    trial = make_trial("niah_single", handle, 160, 5, HAYSTACK)
    snap, roll, question = _rolled(handle, trial)
    for n_new in (2, 3):  # the question + 3 tokens fit the first room (a power of two)
        answer, _ = cap.answer(roll, snap, question, n_new, set(), [1, 2])
        assert len(answer) == n_new
    assert cap.builds == 1 and cap.size[2] >= len(question) + 3
    room = cap.size[2]
    n_new = room - len(question) + 5  # more than the rows hold: rebuilt wider, the answer still right
    answer, got = cap.answer(roll, snap, question, n_new, set(), [1, 2])
    want_answer, want = _live(handle, snap, question, n_new, [1, 2])
    assert cap.builds == 2 and cap.size[2] > room and answer == want_answer
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_trial_under_capture_labels_each_rows_runtime(handle, captured):
    trial = make_trial("niah_single", handle, 160, 3, HAYSTACK)
    specs = parse_cache_specs(["full", WINDOW, "h2o:0.5", "sinks=4,window=72,chunk=8,codec=int8"])
    eager = {r["spec"]: r for r in run_trial(handle, trial, specs, max_new_tokens=6)}
    rows = {r["spec"]: r for r in run_trial(handle, trial, specs, max_new_tokens=6, capture=captured)}
    assert {s: r["runtime"] for s, r in rows.items()} == {
        "full": "eager",
        WINDOW: "compile",
        "h2o:0.5": "eager",
        "sinks=4,window=72,chunk=8,codec=int8": "eager",  # a codec's window has no captured step
    }
    for spec, row in rows.items():
        assert "runtime" not in eager[spec]
        assert row["output"] == eager[spec]["output"] and row["kv_bytes"] == eager[spec]["kv_bytes"]
        assert row["kld"] == pytest.approx(eager[spec]["kld"], abs=1e-5)


def _run_args(*caches: str, trials: int) -> list[str]:
    """``kvlab eval ruler``'s options for ``trials`` niah_single trials at 160 tokens on the CPU."""
    named = [a for c in caches for a in ("--cache", c)]
    return [*named, "--lengths", "160", "--tasks", "niah_single", "--trials", str(trials), "--device", "cpu"]


def _cli(capsys, *args):
    from kvlab.cli import main

    code = main(["eval", "ruler", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cache", "h2o:0.5", "--capture", "compile"], "none of h2o:0.5 is one"),
        (["--cache", "sinks=4,window=72,chunk=8,codec=int8", "--capture", "auto"], "drop --capture"),
        (["--cache", WINDOW, "--capture", "cuda-graph", "--device", "cpu"], "needs a CUDA device"),
        (["--cache", WINDOW, "--capture", "sometimes"], "not one of"),
    ],
)
def test_capture_refusals_are_one_line_before_the_model_loads(args, says, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out and says in err, err
    assert len(err.strip().splitlines()) == 1


def test_kvlab_eval_ruler_capture_compile(handle, tmp_path, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: handle)
    common = _run_args("full", WINDOW, trials=2)
    for capture in ("off", "compile"):
        code, _, err = _cli(capsys, *common, "--capture", capture, "--out", str(tmp_path / capture))
        assert code == 0, err
    off, on = (json.loads((tmp_path / c / "ruler.json").read_text()) for c in ("off", "compile"))
    assert on["settings"]["capture"] == "compile" and "capture" not in off["settings"]
    assert [r["runtime"] for r in on["rows"]] == ["eager", "compile"] * 2
    assert [r["output"] for r in on["rows"]] == [r["output"] for r in off["rows"]]


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_captured_answer_on_every_device(device, tiny_llama_2x64):
    """On each device there is: a CUDA graph on a GPU (compile on the CPU), the live batch's answer and logits
    there. (Not under the meta default device of ``tests/test_devices.py``: the rows are built inside a
    compile.)"""
    import copy

    from kvlab.policy.spec import parse

    h = tiny_llama_2x64
    if device != "cpu":
        model = copy.deepcopy(h.model).to(device)
        h = ModelHandle(model, h.tokenizer, name=h.name, weights_digest=h.weights_digest())
    g = torch.Generator().manual_seed(47)
    ids, question, reference = (torch.randint(3, 500, (n,), generator=g).tolist() for n in (120, 9, 5))
    policy = parse(WINDOW)
    snap = policy.layout.apply(policy, h.prefill(ids, all_logits=False).snapshot, h)[0]
    cap = CapturedAnswers(h, "compile" if device == "cpu" else "cuda-graph")
    answer, got = cap.answer(policy.capturable(), snap, question, 6, set(), reference)
    want_answer, want = _live(h, snap, question, 6, reference)
    assert got.device.type == device and answer == want_answer
    torch.testing.assert_close(got, want, atol=1e-5 if device == "cpu" else 1e-4, rtol=0)


def test_a_model_the_ring_cannot_hold_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """Sliding-window layers (Gemma-3) attend through a window the ring does not mask: refused when the run
    starts (the model known), before a trial runs or ``--out`` holds anything."""
    import kvlab
    from kvlab.errors import UnsupportedModelError
    from kvlab.eval.run import capture_for
    from kvlab.model.facts import load_config_file
    from kvlab.model.random import tiny_random_model
    from tests.conftest import config_path

    h = tiny_random_model(load_config_file(config_path("gemma3")))
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        capture_for(h, parse_cache_specs(["full", WINDOW]), "compile")
    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: h)
    out = tmp_path / "run"
    args = _run_args(WINDOW, trials=1)
    code, _, err = _cli(capsys, *args, "--capture", "compile", "--out", str(out))
    assert code == 2 and "sliding-window" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())
