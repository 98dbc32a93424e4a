"""kvlab.eval.run and ``kvlab eval ruler``: the full loop on a tiny random model, and a real-model smoke."""

from __future__ import annotations

import json

import pytest

from kvlab.errors import BadInputError
from kvlab.eval.run import run_suite, run_trial, summarize
from kvlab.eval.specs import CacheSpec, parse_cache_spec, parse_cache_specs
from kvlab.eval.tasks import make_trial
from tests.test_eval_tasks import HAYSTACK, WordTokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama_2x64):
    from kvlab.model.handle import ModelHandle

    return ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")


def test_cache_specs_parse_in_one_place():
    assert parse_cache_spec("full") == CacheSpec("full")
    s = parse_cache_spec("SnapKV:0.25")
    assert (s.kind, s.method, s.ratio) == ("evict", "snapkv", 0.25) and s.to_json()["keep"] == 0.75
    assert s.spec == "snapkv:0.25" and s.policy.spec == "snapkv,keep=0.75"  # the label is what was written
    assert parse_cache_spec("keynorm:0.5").method == "knorm"
    assert parse_cache_spec("window:0.5").method == "streaming_llm"
    q = parse_cache_spec("int4")
    assert (q.kind, q.method, q.bits) == ("quant", "pertoken", 4)
    assert parse_cache_spec("kivi:int2").method == "kivi"
    assert parse_cache_spec("sinks=4,window=64,codec=fp8").kind == "window"
    for bad in ("bogus", "snapkv", "snapkv:x", "snapkv:1.0", "h2o:-0.1", "int5", "nope:int4", ""):
        with pytest.raises(BadInputError, match="known|fraction|budget|bit width|not a number|must lie"):
            parse_cache_spec(bad)
    with pytest.raises(BadInputError, match="every= keeps a budget while decoding"):
        parse_cache_spec("h2o,keep=0.5,every=32")
    with pytest.raises(BadInputError, match="different per head"):
        parse_cache_spec("h2o,keep=0.5,codec=rotation4")
    with pytest.raises(BadInputError, match="twice"):
        parse_cache_specs(["full", "full"])
    with pytest.raises(BadInputError, match="twice"):  # the same policy under two spellings
        parse_cache_specs(["snapkv:0.5", "snapkv,keep=0.5"])


def test_composed_specs_run_offline(tiny):
    """A window layout, a codec over a window, and eviction + a per-token codec: each runs and holds less."""
    specs = parse_cache_specs(
        ["full", "sinks=4,window=64", "sinks=4,window=64,codec=int4", "h2o,keep=0.5,codec=fp8"]
    )
    trial = make_trial("niah_single", tiny, 200, 1, HAYSTACK)
    full, win, wq, hq = run_trial(tiny, trial, specs, max_new_tokens=3)
    # a rolling window drops whole chunks (32 here): 4 sinks + 33..64 newest slots, as the live cache holds
    assert win["kept_slots"] == wq["kept_slots"] and 4 + 33 <= win["kept_slots"] <= 68
    assert hq["kept_slots"] == round(0.5 * full["context_tokens"])
    assert wq["kv_bytes"] < win["kv_bytes"] < full["kv_bytes"] and hq["kv_bytes"] < full["kv_bytes"] / 2
    assert win["kld"] > 0 and wq["kld"] > 0 and hq["kld"] > 0


def test_the_loop_on_a_tiny_model(tiny):
    specs = parse_cache_specs(["full", "snapkv:0.5", "int2"])
    trial = make_trial("niah_single", tiny, 200, 1, HAYSTACK)
    rows = run_trial(tiny, trial, specs, max_new_tokens=4)
    assert [r["spec"] for r in rows] == ["full", "snapkv:0.5", "int2"]
    full, snap, quant = rows
    assert full["kld"] == 0.0 and full["top1"] == 1.0 and full["kld_answer"] == 0.0
    assert snap["kld"] > 0 and quant["kld"] > 0
    assert snap["kept_slots"] == round(0.5 * full["context_tokens"]) and quant["kv_bytes"] < full["kv_bytes"]
    assert all(0.0 <= r["score"] <= 1.0 and r["compared_tokens"] == full["question_tokens"] + 3 for r in rows)
    assert run_trial(tiny, trial, specs, max_new_tokens=4)[1]["output"] == snap["output"]  # deterministic
    # without `full` asked for, it is still the reference but gets no row
    assert [r["spec"] for r in run_trial(tiny, trial, specs[1:2], max_new_tokens=4)] == ["snapkv:0.5"]


def test_the_answer_equals_the_press(tiny):
    """The eval's evicted cache answers exactly as kvlab's kvpress-style Press (the same policy and ratio)."""
    from kvlab.ops.press import Press

    trial = make_trial("niah_single", tiny, 200, 2, HAYSTACK)
    rows = run_trial(tiny, trial, parse_cache_specs(["h2o:0.5"]), max_new_tokens=6)
    tok = tiny.tokenizer
    press = Press("h2o", compression_ratio=0.5).generate(
        tiny, tok.encode(trial.context), tok.encode(trial.question), max_new_tokens=6
    )
    assert rows[0]["output"] == tok.decode(press[: press.index(0)] if 0 in press else press)


def test_suite_and_summary_are_seeded(tiny):
    specs = parse_cache_specs(["full", "tova:0.5"])
    kw = dict(
        tasks=["niah_single", "vt"], lengths=[160], trials=2, seed=5, haystack_text=HAYSTACK, max_new_tokens=3
    )
    calls = []
    rows = run_suite(tiny, specs, progress=lambda d, n: calls.append((d, n)), **kw)
    assert calls[-1] == (4, 4) and len(rows) == 8
    again = run_suite(tiny, specs, **kw)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("seconds", "prefill_s")} for r in rs]  # noqa: E731
    assert strip(rows) == strip(again)
    summary = summarize(rows)
    full = [s for s in summary if s["cache"] == "full"]
    assert len(summary) == 4 and all(s["kld"]["value"] == 0.0 and s["top1"]["value"] == 1.0 for s in full)
    assert all(s["trials"] == 2 and s["accuracy"]["n"] == 2 for s in summary)
    with pytest.raises(BadInputError, match="unknown eval task"):
        run_suite(tiny, specs, **{**kw, "tasks": ["nope"]})


def _cli(capsys, *args):
    """``kvlab eval ruler ARGS`` through the real entry point: (exit code, stdout, stderr)."""
    from kvlab.cli import main

    code = main(["eval", "ruler", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "args",
    [
        ["--cache", "bogus"],
        ["--cache", "snapkv:2"],
        ["--lengths", "12"],
        ["--lengths", "1024,abc"],
        ["--tasks", "niah_single,nope"],
        ["--trials", "0"],
        ["--haystack", "/nonexistent/file.txt"],
        ["--device", "nonsense"],
    ],
)
def test_bad_cli_input_is_one_line_and_exit_2(args, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_out_that_is_a_file_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = _cli(capsys, "--out", str(f))
    assert code == 2 and "not a folder" in err


@pytest.mark.real_model
def test_real_model_smoke(smollm, tmp_path, monkeypatch, capsys):
    """SmolLM2-135M at ~512 tokens, 3 trials of the single needle: structure, and what it finds."""
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: smollm)
    code, out, err = _cli(
        capsys,
        "--cache", "full", "--cache", "h2o:0.5", "--lengths", "512", "--tasks", "niah_single",
        "--trials", "3", "--out", str(tmp_path), "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    assert "| niah_single | 512 | full | 3 |" in out
    doc = json.loads((tmp_path / "ruler.json").read_text())
    assert len(doc["rows"]) == 6 and {s["cache"] for s in doc["summary"]} == {"full", "h2o:0.5"}
    full = [r for r in doc["rows"] if r["spec"] == "full"]
    assert all(r["kld"] == 0.0 for r in full)
    assert all(r["kld"] > 0 for r in doc["rows"] if r["spec"] != "full")
    print("\nsmollm niah_single@512 full accuracy:", [r["score"] for r in full], [r["output"] for r in full])
