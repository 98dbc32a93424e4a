"""The study's findings that compare two caches say what a paired difference over the same samples says:
kv_swap (the sink's K and V), context_retention (sinks or none), layer_transfer (the best layer window);
hand-made summaries, each way the interval can fall, and no verdict from fewer than 5 samples."""

from __future__ import annotations

import numpy as np

from kvlab.study.experiments import context_retention, kv_swap, layer_transfer


def _iv(value: float, low: float | None, high: float | None, n: int = 8) -> dict:
    return {"value": value, "low": low, "high": high, "n": n}


def _swap(kl_rows: list[list[float]]) -> dict:
    names = [f"{kv_swap.SINK}{x}" for x in ("KV", "K", "V")]
    kl = np.array(kl_rows)
    return {
        "roll": 5,
        "first_token_kl": {
            c: {"value": float(kl[:, j].mean()), "low": None, "high": None} for j, c in enumerate(names)
        },
        "sink_alone_minus_both": kv_swap.sink_paired(kl, names, seed=0),
    }


def test_kv_swap_says_the_sinks_k_and_v_act_together_only_from_paired_intervals():
    rng = np.random.default_rng(0)
    both = rng.uniform(0.1, 2.0, size=8)  # per text sample: a wide spread, each half alone a little higher
    s = _swap([[b, b + 0.05, b + 0.1] for b in both])
    assert abs(s["sink_alone_minus_both"]["K"]["value"] - 0.05) < 1e-9
    text, rows = kv_swap.describe(s)
    assert text.endswith(
        "(K alone − both +0.05 [+0.05, +0.05] (n = 8), V alone − both +0.1 [+0.1, +0.1] (n = 8), paired): they act together."
    )
    assert ("first-token KL, sink K alone minus both (paired)", "+0.05 [+0.05, +0.05] (n = 8)") in rows
    text, _ = kv_swap.describe(_swap([[b, b + 0.05, b] for b in both]))  # V alone is as good as both
    assert "do not show that the sink's K and V need each other" in text
    text, _ = kv_swap.describe(_swap([[b, b + 1, b + 1] for b in both[:3]]))  # 3 samples: no interval
    assert "this run cannot tell" in text and "(n = 3, no interval)" in text and "[" not in text
    old = {k: v for k, v in _swap([[1, 2, 3]] * 5).items() if k != "sink_alone_minus_both"}
    assert "has no paired differences" in kv_swap.describe(old)[0]  # a result from before the field


def test_context_retention_reads_the_sinks_from_the_paired_difference():
    s = {
        "sinks": 4,
        "injected_equals_text": True,
        "accuracy": {k: _iv(0.5, 0.3, 0.7) for k in ("text", "injected", "no_context")},
        "answer_nll_nats": {"repos_0": _iv(3.0, 2.0, 4.0), "repos_4": _iv(2.5, 1.5, 3.5)},
        "sinks_minus_no_sinks_nll": _iv(-0.5, -0.8, -0.2),
    }
    text, rows = context_retention.describe(s)
    assert "as the text itself does, fact by fact" in text
    assert "paired per fact: -0.5 [-0.8, -0.2] (n = 8), the sinks lower it)" in text
    assert ("answer NLL, with sinks minus without (paired per fact)", "-0.5 [-0.8, -0.2] (n = 8)") in rows
    s["sinks_minus_no_sinks_nll"] = _iv(-0.5, -0.8, 0.1)
    assert "no difference seen" in context_retention.describe(s)[0]
    s["sinks_minus_no_sinks_nll"] = _iv(-0.5, None, None, n=3)
    assert "(n = 3, no interval), too few facts for an interval" in context_retention.describe(s)[0]
    s["injected_equals_text"] = False
    assert "not as the text itself does" in context_retention.describe(s)[0]


def test_layer_transfer_says_a_window_carries_the_fact_only_from_the_paired_difference():
    s = {
        "best_window": "window 2-3",
        "answer_nll_nats": {
            "none": _iv(4.0, 3.0, 5.0),
            "all": _iv(1.0, 0.5, 1.5),
            "window 2-3": _iv(2.0, 1.5, 2.5),
        },
        "best_window_minus_none_nll": _iv(-2.0, -2.5, -1.5),
        "best_window_minus_all_nll": _iv(1.0, 0.5, 1.5),
    }
    text, rows = layer_transfer.describe(s)
    assert text.startswith("Of the layer ranges tried, layers 2-3 carry the fact:")
    assert "(minus none, paired per fact: -2 [-2.5, -1.5] (n = 8))" in text
    assert ("answer NLL, best window minus all (paired per fact)", "+1 [+0.5, +1.5] (n = 8)") in rows
    s["best_window_minus_none_nll"] = _iv(-2.0, -2.5, 0.5)
    assert "do not carry the fact more than no layers do" in layer_transfer.describe(s)[0]
    s["best_window_minus_none_nll"] = _iv(-2.0, None, None, n=2)
    assert "too few facts for a paired interval" in layer_transfer.describe(s)[0]
    del s["best_window_minus_none_nll"], s["best_window_minus_all_nll"]
    assert "layers 2-3 give the lowest answer NLL:" in layer_transfer.describe(s)[0]


def test_caching_numerics_names_the_closer_run_from_the_paired_per_step_difference():
    from kvlab.study.experiments.caching_numerics import _closer

    names = ["float32/cached", "float32/recomputed"]
    rng = np.random.default_rng(0)
    base = rng.uniform(1e-6, 1e-3, size=12)  # per step: a wide spread; cached a little below, every step
    assert _closer(np.stack([base, base + 1e-5]), names, ["float32"])["float32"]["closer"] == "cached"
    assert _closer(np.stack([base + 1e-5, base]), names, ["float32"])["float32"]["closer"] == "recomputed"
    mixed = base + np.where(np.arange(12) % 2, 1e-5, -1e-5)
    v = _closer(np.stack([mixed, base]), names, ["float32"])["float32"]
    assert v["closer"] == "neither (contains 0)" and v["cached_closer_fraction"] == 0.5
    few = _closer(np.stack([base[:3], base[:3] + 1e-5]), names, ["float32"])["float32"]
    assert (
        few["closer"] == "cannot tell (n = 3, no interval)"
        and few["cached_minus_recomputed_kl"]["low"] is None
    )


def test_suffix_caching_says_the_sinks_help_only_from_paired_ratios():
    from kvlab.study.experiments import suffix_caching as sc

    rng = np.random.default_rng(0)
    kept = rng.uniform(1e-3, 1.0, size=10)  # per text sample: three orders of magnitude apart
    iv = sc.paired_ratio(kept * 3, kept, seed=0)
    assert abs(iv["value"] - 3) < 1e-9 and iv["n"] == 10  # every sample 3x: a geometric mean of 3
    assert sc.paired_ratio(np.array([np.nan, 0.0]), np.array([1.0, 1.0]), seed=0) is None
    s = {
        "kl_ratio_no_sink_over_sinks_paired": {"n1_sinks4": iv},
        "median_kl_ratio_no_sink_over_sinks": {"n1_sinks4": 3.0},
    }
    text, rows = sc.describe(s)
    assert text.endswith(
        "is 3x that with them kept (geometric mean of the per-text-sample ratios); every cell's "
        "paired 95% interval lies above 1: keeping the sinks brings it closer."
    )
    assert rows[0][0] == "KL without sinks / with sinks, paired per text sample (n1_sinks4)"
    mixed = kept * np.where(np.arange(10) % 2, 3.0, 1 / 3)  # 3x on half the samples, a third on the rest
    s["kl_ratio_no_sink_over_sinks_paired"]["n1_sinks4"] = sc.paired_ratio(mixed, kept, seed=0)
    assert "does not bring it closer everywhere" in sc.describe(s)[0]
    s["kl_ratio_no_sink_over_sinks_paired"]["n1_sinks4"] = sc.paired_ratio(kept[:2] * 3, kept[:2], seed=0)
    assert "this run cannot tell" in sc.describe(s)[0]
    del s["kl_ratio_no_sink_over_sinks_paired"]  # a result from before the paired ratios
    assert sc.describe(s)[0].startswith("Rolling a cached context by re-rotating its keys is 3x closer")


def test_compaction_puts_the_paired_difference_beside_the_centroids():
    from kvlab.study.experiments import compaction

    s = {
        "conversations": 10,
        "centroid": {
            c: {"v_centred": _iv(v, v - 0.1, v + 0.1, 10)}
            for c, v in (("compacted", 0.5), ("verbatim_tail_only", 0.36), ("unrelated", 0.1))
        },
    }
    text, rows = compaction.describe(s)
    assert text.endswith("for an unrelated conversation.")  # a result from before the paired differences
    s["centroid_paired"] = {"verbatim_tail_only": {"v_centred": _iv(0.14, 0.05, 0.2, 10)}}
    text, rows = compaction.describe(s)
    assert text.endswith(
        "(compacted minus the tail alone, paired per conversation: +0.14 [+0.05, +0.2] (n = 10))."
    )
    assert rows[-1] == (
        "centred V centroid cosine, compacted minus verbatim_tail_only (paired)",
        "+0.14 [+0.05, +0.2] (n = 10)",
    )


def test_transplant_reads_the_nll_change_from_the_paired_difference():
    from kvlab.study.experiments import transplant

    own, moved = "docs/base/own cache", "docs/base/transplanted"
    s = {
        "derivative": {"kind": "quantized"},
        own: {"nll": _iv(3.58, 3.2, 4.0)},
        moved: {"top1": _iv(0.9, 0.85, 0.95), "kl": _iv(0.05, 0.04, 0.06), "nll": _iv(3.39, 3.0, 3.8)},
        "random_geometry_ev": {"k": -0.1, "v": -0.2},
        "cross_model": None,
    }
    assert "3.39 vs 3.58 with its own cache)" in transplant.describe(s)[0]  # before the paired difference
    # the intervals of the two NLLs overlap; the paired difference's does not reach 0
    s[moved]["nll_minus_own"] = _iv(-0.19, -0.3, -0.08)
    text = transplant.describe(s)[0]
    assert (
        "transplanted minus own, paired per text sample: -0.19 [-0.3, -0.08] (n = 8), the transplant predicts the text better)"
        in text
    )
    s[moved]["nll_minus_own"] = _iv(-0.19, None, None, 3)
    assert "(n = 3, no interval), too few text samples for an interval)" in transplant.describe(s)[0]


def test_store_reuse_quotes_cacheblend_against_rotation_only_paired():
    from kvlab.study.experiments import store_reuse

    s = {
        "kl_mean": {"none": 0.5, "cacheblend": 0.3},
        "cacheblend_minus_rotation_only_kl": _iv(-0.2, -0.3, -0.1),
    }
    text, rows = store_reuse.describe(s)
    assert text.endswith(
        "with CacheBlend's correction (minus rotation only, paired per question: -0.2 [-0.3, -0.1] (n = 8))."
    )
    assert rows[-1] == (
        "non-prefix reuse KL, CacheBlend minus rotation only (paired per question)",
        "-0.2 [-0.3, -0.1] (n = 8)",
    )
    del s["cacheblend_minus_rotation_only_kl"]  # a result from before the paired difference
    assert store_reuse.describe(s)[0].endswith("with CacheBlend's correction.")
