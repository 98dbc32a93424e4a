"""Streaming perplexity methods, the two experiments (smoke), and the generate/chat commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvlab.errors import BadInputError
from kvlab.metrics import nll
from kvlab.streaming import (
    TABLE_COLUMNS,
    stream_nll,
    streaming_perplexity,
    subsample_targets,
    summarize,
    table_row,
)
from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.runner import run_experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stream(tiny_model):
    h = tiny_model("llama")
    return h, torch.randint(0, 500, (130,), generator=torch.Generator().manual_seed(0)).tolist()


def test_full_and_recompute_are_exact(stream):
    h, ids = stream
    full = stream_nll(h, ids, "full", window=32)
    ref = nll(h.prefill(ids).logits[:-1], torch.tensor(ids[1:])).numpy()
    assert np.allclose(full.nll, ref, atol=1e-4)
    rec = stream_nll(h, ids, "recompute", window=32, recompute_targets=[40, 77, 129], recompute_batch=2)
    for t, v in zip(rec.targets, rec.nll, strict=True):
        want = float(nll(h.prefill(ids[t - 32 : t]).logits[-1:], torch.tensor([ids[t]]))[0])
        assert abs(v - want) < 1e-4


def test_window_repositioned_equals_absolute(stream):
    h, ids = stream
    a = stream_nll(h, ids, "window", window=24, feed=4)
    b = stream_nll(h, ids, "window_abs", window=24, feed=4, path="loop")  # the cache itself, not the mask
    assert a.extra["path"] == b.extra["path"] == "loop"
    assert a.extra["rebases"] > 5 and b.extra["rebases"] == 0
    assert a.extra["max_position"] < 24 + 8 < b.extra["max_position"]
    assert np.allclose(a.nll, b.nll, atol=1e-4)


def test_no_eviction_equals_full(stream):
    h, ids = stream
    a = stream_nll(h, ids[:60], "sinks4", window=100, feed=8)
    assert np.allclose(a.nll, stream_nll(h, ids[:60], "full", window=100).nll, atol=1e-4)


def test_all_methods_share_targets_and_bad_input(stream):
    h, ids = stream
    res = streaming_perplexity(h, ids, window=32, feed=8, recompute_samples=10)
    sub = res["recompute"].targets
    assert set(res) >= {"full", "window", "window_abs", "sinks1", "sinks8", "recompute"}
    for r in res.values():
        assert np.isfinite(r.ppl_on(sub))
    with pytest.raises(BadInputError, match="unknown streaming method"):
        stream_nll(h, ids, "nope", window=32)
    with pytest.raises(BadInputError):
        streaming_perplexity(h, ids[:20], window=32)


def test_stride_subsample_and_paired_summary(stream):
    h, ids = stream
    assert subsample_targets(130, 32, stride=10).tolist() == list(range(32, 130, 10))
    with pytest.raises(BadInputError):
        subsample_targets(130, 32, stride=0)
    res = streaming_perplexity(
        h, ids, window=32, feed=8, methods=["window", "sinks1", "recompute"], recompute_stride=10
    )
    assert res["recompute"].targets.tolist() == list(range(32, 130, 10))
    rows = summarize(res, "random", 32)
    assert [r["method"] for r in rows] == ["window", "sinks1", "recompute"]
    for r in rows:  # the paired ratio is the ratio of perplexities on the same targets
        sub = res[r["method"]].ppl_on(res["recompute"].targets)
        assert r["ratio_to_recompute"] == pytest.approx(sub / res["recompute"].ppl, rel=1e-9)
        assert len(table_row(r)) == len(TABLE_COLUMNS)


def _hand_kl(full: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per row, sum_v p_v (log p_v - log q_v) in float64 numpy."""

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(full), log_softmax(other)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_divergence_to_the_full_context(stream):
    """With ``full`` among the methods, every method's per-target KL to the full context and top-1
    agreement come from its own forwards: the full context against itself is 0 and 1, a rolling method's
    values match a hand computation on its logits, the masked path matches the cache loop."""
    h, ids = stream
    res = streaming_perplexity(
        h, ids, window=32, feed=8, methods=["window", "sinks1", "full", "recompute"], recompute_stride=24
    )
    assert list(res) == ["window", "sinks1", "full", "recompute"]  # the caller's order, full ran first
    assert np.all(res["full"].kl == 0) and np.all(res["full"].top1 == 1)
    for r in res.values():
        assert r.kl.shape == r.top1.shape == r.targets.shape and r.logits is None
        assert np.all(np.isfinite(r.kl)) and np.all(r.kl >= 0) and set(np.unique(r.top1)) <= {0.0, 1.0}
    ref = h.prefill(ids).logits[:-1]  # query i predicts token i + 1
    for method, path in (("sinks1", "masked"), ("sinks1", "loop"), ("window", "loop")):
        own = stream_nll(h, ids, method, window=32, feed=8, path=path, reference=ref, keep_logits=True)
        assert own.extra["path"] == path
        hand = _hand_kl(ref.numpy(), own.logits.numpy())
        assert np.allclose(own.kl, hand, rtol=1e-9, atol=1e-12), (method, path)
        assert np.array_equal(own.top1, (ref.argmax(-1) == own.logits.argmax(-1)).numpy().astype(float))
        assert np.allclose(own.kl, res[method].kl, atol=1e-5)  # masked or loop, the same values
    assert np.all(res["sinks1"].kl[:32] < 1e-6) and res["sinks1"].kl[40:].mean() > 1e-3  # eviction shows
    rec = res["recompute"]
    for t, kl in zip(rec.targets, rec.kl, strict=True):  # each target from a fresh window prefill
        own = h.prefill(ids[t - 32 : t]).logits[-1:]
        assert kl == pytest.approx(float(_hand_kl(ref[t - 1 : t].numpy(), own.numpy())[0]), rel=1e-4)
    rows = {r["method"]: r for r in summarize(res, "random", 32)}
    assert rows["full"]["kl_to_full"]["value"] == 0 and rows["full"]["top1_to_full"]["value"] == 1
    assert rows["sinks1"]["kl_to_full"]["value"] == pytest.approx(res["sinks1"].kl[31:].mean())
    # without the full context there is nothing to compare with
    alone = streaming_perplexity(
        h, ids, window=32, feed=8, methods=["sinks1", "recompute"], recompute_stride=24
    )
    assert alone["sinks1"].kl is None and "kl_to_full" not in summarize(alone, "random", 32)[0]
    with pytest.raises(BadInputError, match="reference logits"):
        stream_nll(h, ids, "sinks1", window=32, reference=ref[:-1])


@pytest.mark.real_model
@pytest.mark.slow
def test_streaming_experiment_smoke(smollm, tmp_path):
    ctx = ExperimentContext(
        out_dir=tmp_path / "sp",
        profile="quick",
        options={"tokens": 120, "windows": [32], "recompute_stride": 20, "sinks": [1, 4]},
    )
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("streaming_ppl"), ctx)
    assert result.status == "ok", result.notes
    # the text's label is its description, not cut at the dot in "pydoc_data.topics"
    assert {r["source"] for r in result.summary["rows"]} == {"Python documentation"}
    assert "sinks4_over_recompute_Python documentation_w32" in result.summary
    doc = json.loads((tmp_path / "sp" / "result.json").read_text())
    assert doc["tables"]
    assert (tmp_path / "sp" / "ppl_by_method.png").is_file()
    assert (tmp_path / "sp" / "arrays.npz").is_file()
    # KL to the full context and top-1 agreement, per method, with intervals; full against itself 0 and 1
    table = result.tables[0]
    assert {"KL to full (nats)", "top-1 agreement"} <= set(table.columns)
    by_method = {r["method"]: r for r in result.summary["rows"]}
    assert by_method["full"]["kl_to_full"]["value"] == 0 and by_method["full"]["top1_to_full"]["value"] == 1
    for r in result.summary["rows"]:
        assert np.isfinite(r["kl_to_full"]["value"]) and r["kl_to_full"]["value"] >= 0, r["method"]
        assert 0 <= r["top1_to_full"]["value"] <= 1
    assert by_method["sinks4"]["kl_to_full"]["value"] > 0
    arrays = np.load(tmp_path / "sp" / "arrays.npz")
    kl = arrays["Python documentation_w32_sinks4_kl_to_full"]
    assert kl.shape == arrays["Python documentation_w32_sinks4_targets"].shape and np.all(kl >= 0)
    # --loop feeds the cache itself: the same numbers (masked path within rounding), said in the table
    ref = ExperimentContext(out_dir=tmp_path / "loop", profile="quick", options={**ctx.options, "loop": True})
    ref.model_handle = smollm
    looped = run_experiment(get_experiment("streaming_ppl"), ref)
    paths = {r["method"]: r.get("path") for r in result.summary["rows"]}
    assert paths["sinks4"] == "masked" and paths["window"] == "loop"
    assert {r["method"]: r.get("path") for r in looped.summary["rows"]}["sinks4"] == "loop"
    for a, b in zip(result.summary["rows"], looped.summary["rows"], strict=True):
        assert a["ppl_all"] == pytest.approx(b["ppl_all"], rel=1e-4), a["method"]


@pytest.mark.real_model
def test_asking_for_more_tokens_than_the_text_has_is_refused_not_shortened(smollm, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A short text about lighthouses and the sea. " * 20)
    ctx = ExperimentContext(
        out_dir=tmp_path / "sp",
        profile="quick",
        options={"tokens": 5000, "windows": [32], "text_file": str(short)},
    )
    ctx.model_handle = smollm
    with pytest.raises(BadInputError, match="--tokens 5000 asks for more"):
        run_experiment(get_experiment("streaming_ppl"), ctx)


@pytest.mark.real_model
@pytest.mark.slow
def test_suffix_experiment_smoke(smollm, tmp_path):
    ctx = ExperimentContext(
        out_dir=tmp_path / "sc", profile="quick", options={"windows": 2, "context_tokens": 48}
    )
    ctx.model_handle = smollm
    result = run_experiment(get_experiment("suffix_caching"), ctx)
    assert result.status == "ok", result.notes
    assert (tmp_path / "sc" / "kl_by_drop.png").is_file()
    arrays = np.load(tmp_path / "sc" / "arrays.npz")
    assert arrays["kl_to_reprefill"].shape == (2, 2, 2)
    ratios = result.summary["median_kl_ratio_no_sink_over_sinks"]
    assert all(np.isfinite(v) for v in ratios.values())
    paired = result.summary["kl_ratio_no_sink_over_sinks_paired"]  # per text sample: 2, no interval
    assert set(paired) == set(ratios) and all(v["n"] == 2 and v["low"] is None for v in paired.values())
    assert "this run cannot tell" in result.finding
    # the rolled cache and the re-prefill against the full context, over every continuation token
    for key in ("kl_to_full_rolled", "top1_to_full_rolled", "kl_to_full_reprefill", "top1_to_full_reprefill"):
        x = arrays[key]
        assert x.shape == (2, 2, 2) and np.all(np.isfinite(x)) and np.all(x >= 0), key
    assert np.all(arrays["top1_to_full_rolled"] <= 1)
    assert np.all(arrays["kl_to_full_full"] == 0) and np.all(arrays["top1_to_full_full"] == 1)
    table = next(t for t in result.tables if "KL to full (nats)" in t.columns)
    assert "top-1 agreement" in table.columns and table.rows[0][3] == "full context"
    kl_full = result.summary["kl_to_full"]
    assert kl_full["full"]["kl"]["value"] == 0 and kl_full["full"]["top1"]["value"] == 1
    cells = [v for k, v in kl_full.items() if k != "full"]
    assert len(cells) == 4 and all(c["rolled"]["kl"]["n"] == 2 for c in cells)
    # two text samples: no interval, so no verdict either way (and the line says why)
    assert all(c["verdict"] == "undecided (no interval: fewer than 5 text samples)" for c in cells)


@pytest.mark.real_model
def test_generate_and_chat_commands(smollm):
    from kvlab.cli import app

    runner = CliRunner()
    out = runner.invoke(
        app, ["generate", "The river", "-n", "12", "-w", "8", "-s", "2", "--evict-chunk", "2", "--stats"]
    )
    assert out.exit_code == 0, out.output
    assert "rolls" in out.output
    chat = runner.invoke(
        app, ["chat", "-w", "48", "-s", "4", "--evict-chunk", "8", "-n", "6"], input="Hi there\nAnd again?\n"
    )
    assert chat.exit_code == 0, chat.output
    assert "bye" in chat.output and chat.output.count("tokens/s") == 2


def test_source_names_are_short_and_never_cut_at_a_dot():
    from kvlab.study.experiments.streaming_ppl import source_name

    assert source_name("frankenstein.txt") == "frankenstein"
    assert source_name("/data/books/moby.dick.txt") == "moby.dick"
    assert (
        source_name("Python documentation (pydoc_data.topics, shipped with CPython)")
        == "Python documentation"
    )
    assert source_name("conversations file chat.v2.json") == "conversations file chat.v2.json"
