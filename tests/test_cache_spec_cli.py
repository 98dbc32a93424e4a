"""``kvlab generate --cache SPEC`` and ``kvlab stream-ppl --cache SPEC`` (issue 28, item 4): the live
cache any spec names, generated through and scored, on a tiny random model; the CLI's refusals."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.policy.spec import cache_for
from kvlab.streaming.generate import HeldBytes, policy_generate
from kvlab.streaming.perplexity import streaming_perplexity, summarize


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def _generate(handle, spec: str, n: int, prompt: int = 24):
    cache, held, peaks = cache_for(spec, handle), HeldBytes(), []
    tokens = []
    for tok in policy_generate(handle, cache, list(range(1, prompt + 1)), n, held=held):
        tokens.append(tok)
        peaks.append(held.now)
    return cache, held, tokens, peaks


@pytest.mark.slow  # generates past the window, seconds each: kept out of `make test-fast` (and the next)
@pytest.mark.parametrize("spec", ["sinks=4,window=128,codec=kivi4", "sinks=4,window=64,codec=fp8"])
def test_coded_window_generates_past_the_window_with_bounded_bytes(llama, spec):
    cache, held, tokens, peaks = _generate(llama, spec, 400)
    assert len(tokens) == 400 and cache.rolls > 0  # far past the window
    window = cache.window
    assert cache.kept <= cache.sinks + window
    # bounded: what the cache holds after the window has filled never grows past the first full roll
    assert max(peaks[200:]) <= max(peaks[: 2 * window]) and held.peak == max(peaks)
    fp, fp_held, _, _ = _generate(llama, f"sinks=4,window={window}", 50)
    assert held.peak < fp_held.peak * 1.05


@pytest.mark.slow
def test_h2o_every_stays_within_budget(llama):
    cache, held, tokens, peaks = _generate(llama, "h2o,keep=0.5,every=16", 300, prompt=64)
    assert len(tokens) == 300
    full, full_held, _, _ = _generate(llama, "full", 300, prompt=64)
    # a budget of half the 64-token prompt, plus at most one chunk of 16 between evictions
    per_slot = full_held.now / (64 + 300)
    assert max(peaks) <= per_slot * (32 + 16) * 1.5 < full_held.now / 3


def test_full_and_codec_only_run_the_loop(llama):
    a = _generate(llama, "full", 20)[2]
    ids = torch.tensor([list(range(1, 25))])
    ref = llama.model.generate(ids, max_new_tokens=20, do_sample=False)[0, 24:].tolist()
    assert a == ref
    assert len(_generate(llama, "int4", 20)[2]) == 20


def test_stream_ppl_specs_next_to_the_methods(llama):
    ids = torch.randint(1, 500, (330,), generator=torch.Generator().manual_seed(0)).tolist()
    specs = ["sinks=4,window=64", "sinks=4,window=64,codec=int4", "sinks=4,window=64,codec=fp8"]
    res = streaming_perplexity(
        llama, ids, window=64, methods=["full", "sinks4", *specs, "recompute"], recompute_samples=10
    )
    rows = {r["method"]: r for r in summarize(res, "random", 64)}
    fp = rows["sinks=4,window=64"]
    assert fp["path"] == "masked" and fp["ppl_all"] == pytest.approx(rows["sinks4"]["ppl_all"], rel=1e-6)
    for spec in ("sinks=4,window=64,codec=pertoken4", "sinks=4,window=64,codec=fp8"):
        r = rows[spec]
        assert r["path"] == "loop" and r["fp_window_method"] == "sinks=4,window=64"
        # int4 / fp8 over a 64-slot window: within 10% of full precision (a random model's perplexity)
        assert 0.9 < r["ratio_to_fp_window"] < 1.1
        assert r["ratio_to_fp_window_low"] <= r["ratio_to_fp_window"] <= r["ratio_to_fp_window_high"]
        assert "kl_to_full" in r and r["peak_held_bytes"] > 0


@pytest.mark.real_model
def test_generate_cache_json_on_the_bundled_model(capsys):
    from kvlab.cli import main

    code = main(["generate", "Once upon a time", "-n", "8", "--cache", "sinks=4,window=64,codec=fp8",
                 "--json", "--device", "cpu"])  # fmt: skip
    assert code in (0, None)
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["tokens"] == 8 and doc["policy"]["spec"] == "sinks=4,window=64,codec=fp8"
    assert doc["policy"]["codec"] == "fp8" and 0 < doc["held_bytes"] <= doc["peak_held_bytes"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["generate", "hi", "--cache", "h2o,keep=2"], "keep must be a fraction"),
        (["generate", "hi", "--cache", "sinks=4,window=64", "--window", "64"], "drop --window"),
        (["generate", "hi", "--cache", "sinks=4,window=64", "-s", "2"], "drop --sinks"),
        (["generate", "hi", "--cache", "full", "--capture", "compile"], "--capture compile"),
        pytest.param(
            ["generate", "hi", "--cache", "sinks=4,window=100000"],
            "maximum position",
            marks=pytest.mark.real_model,
        ),
        (["stream-ppl", "--cache", "nope"], "unknown item"),
        (["stream-ppl", "--cache", "int4", "--cache", "codec=int4"], "given twice"),
    ],
)
def test_bad_cache_options_are_one_line_exit_2(argv, fragment, capsys):
    from kvlab.cli import main

    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and fragment in err[0], err


@pytest.mark.real_model
def test_stream_ppl_cache_on_the_bundled_model(capsys, tmp_path):
    """``kvlab stream-ppl --cache``: an fp8 window (a codec added in one file) is scored next to the
    methods, paired with the full-precision window of the same layout."""
    from kvlab.cli import main

    argv = ["stream-ppl", "--quick", "--window", "64", "--sinks", "4", "--tokens", "150", "--recompute-samples", "2",
            "--cache", "sinks=4,window=64,chunk=32,codec=fp8", "--cache", "sinks=4,window=64,chunk=32",
            "--json", "--out", str(tmp_path), "--device", "cpu"]  # fmt: skip
    assert main(argv) in (0, None)
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{") :])
    rows = {r["method"]: r for r in doc["summary"]["rows"]}
    r = rows["sinks=4,window=64,chunk=32,codec=fp8"]
    assert r["fp_window_method"] == "sinks=4,window=64,chunk=32"
    assert r["ratio_to_fp_window_low"] <= r["ratio_to_fp_window"] <= r["ratio_to_fp_window_high"]
    assert 0.95 < r["ratio_to_fp_window"] < 1.05  # fp8 costs little
