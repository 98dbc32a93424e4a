"""The statistics rules, in the one place every experiment inherits them from: no interval from fewer
than 5 samples or with non-finite bounds, Wilson intervals for proportions (non-degenerate at 0/n and
n/n), and a formatter that writes "no interval" instead of ``[nan, nan]``."""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import BadInputError
from kvlab.metrics.stats import (
    MIN_SAMPLES,
    Interval,
    bootstrap_ci,
    bootstrap_curve,
    paired_share_ci,
    wilson_ci,
)
from kvlab.study.report.format import format_interval, iv


def test_no_interval_from_fewer_than_five_samples():
    assert MIN_SAMPLES == 5
    one = bootstrap_ci([0.5])
    assert one.n == 1 and math.isnan(one.low) and not one.has_interval
    assert one.to_json() == {"value": 0.5, "low": None, "high": None, "n": 1}
    assert "no interval" in one.text()
    four = bootstrap_ci([0.4, 0.6, 0.5, 0.7], seed=1)
    assert four.n == 4 and four.value == pytest.approx(0.55) and four.to_json()["low"] is None
    five = bootstrap_ci([0.4, 0.6, 0.5, 0.7, 0.45], seed=1)
    assert five.n == 5 and five.low < five.value < five.high and five.to_json()["low"] is not None


def test_nan_samples_are_dropped_and_count_against_n():
    x = bootstrap_ci([0.1, float("nan"), 0.2, 0.3, float("nan"), 0.4])
    assert x.n == 4 and x.value == pytest.approx(0.25) and not x.has_interval
    with pytest.raises(BadInputError):
        bootstrap_ci([float("nan"), float("nan")])


def test_a_band_needs_five_curves():
    mean, lo, hi = bootstrap_curve(np.array([[1.0, 2.0]] * 4))
    assert np.isnan(lo).all() and np.isnan(hi).all() and mean.tolist() == [1.0, 2.0]
    rng = np.random.default_rng(0)
    mean, lo, hi = bootstrap_curve(rng.normal(size=(6, 3)))
    assert np.isfinite(lo).all() and (lo <= mean).all() and (mean <= hi).all()


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [(0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (5, 10, 0.2366, 0.7634), (1, 20, 0.0089, 0.2361)],
)
def test_wilson_matches_the_textbook_values(k, n, low, high):
    got = wilson_ci([1.0] * k + [0.0] * (n - k))
    assert got.value == pytest.approx(k / n) and got.n == n
    assert got.low == pytest.approx(low, abs=5e-4) and got.high == pytest.approx(high, abs=5e-4)


def test_wilson_at_0_and_n_is_not_degenerate_where_the_bootstrap_is():
    assert bootstrap_ci([1.0] * 8).low == bootstrap_ci([1.0] * 8).high == 1.0  # why proportions need Wilson
    for outcomes in ([0.0] * 8, [1.0] * 8):
        w = wilson_ci(outcomes)
        assert w.high - w.low > 0.2 and 0.0 <= w.low <= w.high <= 1.0
        assert format_interval(w).count("[") == 1 and "[1, 1]" not in format_interval(w)


def test_every_wilson_interval_holds_its_own_proportion_exactly():
    """k/n for every k <= n <= 150: low <= value <= high with no float slack. Rounding had put 0/n's low
    end 3e-17 above 0 and n/n's high end an ulp below 1: a figure's error bar (value - low) came out
    negative and matplotlib refused the study's retention plot."""
    for n in range(5, 151):
        for k in range(n + 1):
            w = wilson_ci([1.0] * k + [0.0] * (n - k))
            assert 0.0 <= w.low <= w.value <= w.high <= 1.0, (k, n, w)
        assert wilson_ci([0.0] * n).low == 0.0 and wilson_ci([1.0] * n).high == 1.0


def test_every_paired_share_interval_holds_its_own_difference():
    for n in (5, 6, 17, 40):
        for b10 in range(n + 1):
            for b01 in range(n - b10 + 1):
                a = [1.0] * b10 + [0.0] * b01 + [1.0] * (n - b10 - b01)
                b = [0.0] * b10 + [1.0] * b01 + [1.0] * (n - b10 - b01)
                iv = paired_share_ci(a, b)
                assert -1.0 <= iv.low <= iv.value <= iv.high <= 1.0, (b10, b01, n, iv)


def test_wilson_on_shares_and_its_refusals():
    shares = wilson_ci([0.9, 0.95, 1.0, 0.85, 0.9, np.nan])  # one text sample's own share each
    assert shares.n == 5 and shares.value == pytest.approx(0.92) and shares.low < 0.92 < shares.high
    assert not wilson_ci([1.0, 0.0, 1.0, 1.0]).has_interval  # 4 trials
    with pytest.raises(BadInputError):
        wilson_ci([0.5, 1.5, 0.2, 0.3, 0.4])
    with pytest.raises(BadInputError):
        wilson_ci([])


def _tango_score_by_optimizer(b10: float, b01: float, n: int, delta: float) -> float:
    """Tango's score statistic with the constrained MLE found numerically (not by the closed form)."""
    from scipy.optimize import minimize_scalar

    lo, hi = max(0.0, -delta), (1 - delta) / 2  # q01 with q10 = q01 + delta and q10 + q01 <= 1

    def nll(q: float) -> float:
        return -(
            b10 * math.log(q + delta + 1e-300)
            + b01 * math.log(q + 1e-300)
            + (n - b10 - b01) * math.log(1 - 2 * q - delta)
        )

    q = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
    return (b10 - b01 - n * delta) / math.sqrt(n * (2 * q + delta * (1 - delta)))


@pytest.mark.parametrize("b10,b01,n", [(0, 0, 40), (5, 1, 60), (1, 9, 210), (12, 12, 30), (30, 0, 30)])
def test_paired_shares_are_tangos_score_interval_on_0_1_scores(b10, b01, n):
    a = np.array(
        [1.0] * b10
        + [0.0] * b01
        + [1.0] * ((n - b10 - b01) // 2)
        + [0.0] * (n - b10 - b01 - (n - b10 - b01) // 2)
    )
    b = np.array([0.0] * b10 + [1.0] * b01 + list(a[b10 + b01 :]))
    iv = paired_share_ci(a, b)
    assert iv.n == n and iv.value == pytest.approx((b10 - b01) / n)
    assert iv.low <= iv.value <= iv.high
    for bound, z in ((iv.low, 1.959964), (iv.high, -1.959964)):  # the score crosses -+z at each bound ...
        if abs(bound) < 1 - 1e-9:  # ... unless the bound is the edge of the range
            assert _tango_score_by_optimizer(b10, b01, n, bound) == pytest.approx(z, abs=1e-4)


def test_paired_shares_keep_their_width_when_every_pair_ties():
    """The case a bootstrap of the differences collapses to [0, 0]: Tango gives +-z^2 / (n + z^2)."""
    ties = paired_share_ci([1.0] * 20 + [0.0] * 20, [1.0] * 20 + [0.0] * 20)
    half = 1.959964**2 / (40 + 1.959964**2)
    assert (
        ties.value == 0
        and ties.low == pytest.approx(-half, abs=1e-6)
        and ties.high == pytest.approx(half, abs=1e-6)
    )
    assert bootstrap_ci(np.zeros(40)).high == 0  # what it replaces
    partial = paired_share_ci([0.5] * 40, [0.5] * 40)  # ties with partial credit: the same as 0/1 ties
    assert (partial.low, partial.high) == pytest.approx((ties.low, ties.high))


def test_paired_shares_cover_the_true_difference():
    """Coverage over 1,000 seeded experiments of 50 correlated pairs, 0/1 and partial credit (quarters)."""
    rng = np.random.default_rng(7)
    hits = {"0/1": 0, "quarters": 0}
    for _ in range(1000):
        a = (rng.random(50) < 0.6).astype(float)
        b = np.where(rng.random(50) < 0.1, 1 - a, a)  # E[a - b] = 0.1 * (2 * 0.6 - 1) = 0.02
        iv = paired_share_ci(a, b)
        hits["0/1"] += iv.low <= 0.02 <= iv.high
        q = rng.integers(0, 5, 50) / 4
        r = np.clip(q + rng.choice([-0.25, 0.0, 0.0, 0.0, 0.25, 0.5], 50), 0, 1)
        truth = float(
            np.mean(
                [
                    np.mean(np.clip(k / 4 + np.array([-0.25, 0, 0, 0, 0.25, 0.5]), 0, 1)) - k / 4
                    for k in range(5)
                ]
            )
        )
        iv = paired_share_ci(r, q)
        hits["quarters"] += iv.low <= truth <= iv.high
    assert 0.93 <= hits["0/1"] / 1000 <= 0.975, hits
    assert 0.93 <= hits["quarters"] / 1000 <= 0.985, hits


def test_paired_shares_refusals_and_small_samples():
    four = paired_share_ci([1, 0, 1, 1], [0, 0, 1, 1])
    assert four.n == 4 and not four.has_interval and four.value == 0.25
    nan = paired_share_ci([1, 0, float("nan"), 1, 1, 0], [0, 0, 1, 1, 1, 0])
    assert nan.n == 5
    with pytest.raises(BadInputError, match="one length"):
        paired_share_ci([1, 0], [1])
    with pytest.raises(BadInputError, match=r"\[0, 1\]"):
        paired_share_ci([1.5] * 5, [1.0] * 5)


def test_the_formatter_never_writes_nan_or_an_interval_under_five_samples():
    assert format_interval(Interval(0.5, 0.25, 0.75, 8)) == "0.5 [0.25, 0.75] (n = 8)"
    assert format_interval(Interval(0.5, 0.25, 0.75, 4)) == "0.5 (n = 4, no interval)"
    assert format_interval(Interval(0.5, math.nan, math.nan, 20)) == "0.5 (n = 20, no interval)"
    assert format_interval({"value": 0.5, "low": None, "high": None, "n": 2}) == "0.5 (n = 2, no interval)"
    assert format_interval(0.5, math.nan, math.inf) == "0.5"
    assert format_interval(1.5, 0.5, 2.25, n=6, signed=True) == "+1.5 [+0.5, +2.25] (n = 6)"
    assert iv({"d": {"value": -3.0, "low": None, "high": None, "n": 1}}, "d", signed=True) == (
        "-3 (n = 1, no interval)"
    )
    for text in (format_interval(Interval(math.nan, math.nan, math.nan, 1)), format_interval(math.nan)):
        assert "nan" not in text.lower()


# -- the scan of a study's output (used on every quick study the suite runs) ------------------------
#: the names of quantities that are proportions: their intervals must be Wilson, never a collapsed [x, x]
PROPORTION = re.compile(r"top[-_ ]?1|accuracy|agree|\bhits?\b|hit_rate|found|exact", re.I)
BRACKET = re.compile(r"\[([^\[\]]*?), ([^\[\]]*?)\](?: \(n = (\d+)\))?")


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, node


def _text_problems(text: str, where: str, proportion: bool = False) -> list[str]:
    out = []
    for m in BRACKET.finditer(text):
        lo, hi, n = m.group(1), m.group(2), m.group(3)
        if "nan" in (lo + hi).lower():
            out.append(f"{where}: a nan interval in {text!r}")
        if n is not None and int(n) < MIN_SAMPLES:
            out.append(f"{where}: an interval from n = {n} in {text!r}")
        if proportion and lo.strip() == hi.strip():
            out.append(f"{where}: a degenerate proportion interval in {text!r}")
    for m in re.finditer(r"\(n = (\d+)[,)]", text):
        if int(m.group(1)) < MIN_SAMPLES and not text[m.start() :].startswith(
            f"(n = {m.group(1)}, no interval"
        ):
            out.append(f"{where}: n = {m.group(1)} without 'no interval' in {text!r}")
    return out


def interval_problems(doc: dict, name: str) -> list[str]:
    """What breaks the statistics rules in one experiment's result.json: a NaN bound, an interval from
    fewer than MIN_SAMPLES samples, a collapsed proportion interval, and the same in its tables and
    headline as the report writes them."""
    out = []
    for path, node in _walk(doc.get("summary", {})):
        where = f"{name}{path}"
        if isinstance(node, float) and math.isnan(node) and re.search(r"(low|high|_ci)(\b|_|$)", path):
            out.append(f"{where}: a NaN interval bound")
        if not isinstance(node, dict) or "low" not in node or "high" not in node:
            continue
        lo, hi = node["low"], node["high"]
        if lo is None and hi is None:
            continue
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
            out.append(f"{where}: bounds {lo}, {hi}")
        elif not isinstance(node.get("n"), int) or node["n"] < MIN_SAMPLES:
            out.append(f"{where}: an interval from n = {node.get('n')}")
        elif lo == hi and PROPORTION.search(path):
            out.append(f"{where}: a degenerate proportion interval [{lo}, {hi}]")
    for label, value in doc.get("headline", []):
        out += _text_problems(str(value), f"{name} headline {label!r}", bool(PROPORTION.search(label)))
    for t in doc.get("tables", []):
        for row in t["rows"]:
            for col, cell in zip(t["columns"], row, strict=False):
                where = f"{name} table {t['title']!r}, {col!r}"
                out += _text_problems(str(cell), where, bool(PROPORTION.search(col)))
    return out


def study_interval_problems(root: Path) -> list[str]:
    """:func:`interval_problems` of every result.json under ``root``, and NaN intervals in its pages."""
    out = []
    for path in sorted(root.rglob("result.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "summary" in doc and "tables" in doc:
            out += interval_problems(doc, path.parent.name)
    for page in sorted(root.rglob("index.html")):
        text = html.unescape(re.sub(r"<[^>]+>", " ", page.read_text()))
        out += [f"{page}: {p}" for p in _text_problems(text, page.parent.name) if "nan" in p]
    return out


def test_the_scan_finds_what_it_looks_for():
    bad = {
        "summary": {
            "kl": {"value": 0.1, "low": 0.05, "high": 0.2, "n": 3},
            "top1": {"value": 1.0, "low": 1.0, "high": 1.0, "n": 8},
            "ppl_increase_ci": [float("nan"), float("nan")],
        },
        "headline": [("top-1 agreement", "1 [1, 1] (n = 8)")],
        "tables": [{"title": "t", "columns": ["Δ ppl"], "rows": [["+0.5% [+nan, +nan]"], ["0.4 (n = 2)"]]}],
    }
    found = interval_problems(bad, "x")
    expected = [
        "x.kl: an interval from n = 3",
        "x.top1: a degenerate proportion interval",
        "x.ppl_increase_ci[0]: a NaN interval bound",
        "x.ppl_increase_ci[1]: a NaN interval bound",
        "x headline 'top-1 agreement': a degenerate proportion interval",
        "x table 't', 'Δ ppl': a nan interval",
        "x table 't', 'Δ ppl': n = 2 without 'no interval'",
    ]
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected, strict=True))
    good = {
        "summary": {"kl": Interval(0.1, 0.05, 0.2, 6).to_json(), "top1": wilson_ci([1.0] * 8).to_json()},
        "headline": [("top-1", format_interval(wilson_ci([1.0] * 8)))],
        "tables": [{"title": "t", "columns": ["kl"], "rows": [[format_interval(bootstrap_ci([0.1, 0.2]))]]}],
    }
    assert interval_problems(good, "x") == []


def test_the_eval_reports_accuracy_with_wilson_and_ranks_caches_paired():
    """`kvlab eval`'s summary (and the benchmark's report) give accuracy at 0/n a real interval, and the
    ranking compares each cache with the full cache and its neighbour on the same trials."""
    import sys

    from kvlab.eval.run import summarize

    rows = [
        {
            "task": "vt",
            "spec": spec,
            "length": 1024,
            "trial": t,
            "score": score(t),
            "kld": 0.1,
            "top1": 0.9,
            "kld_answer": 0.1,
            "seconds": 1.0,
        }
        for spec, score in (("full", lambda t: 1.0), ("h2o", lambda t: float(t % 2)), ("int2", lambda t: 0.0))
        for t in range(10)
    ]
    acc = {s["cache"]: s["accuracy"] for s in summarize(rows)}
    assert acc["int2"]["value"] == 0 and acc["int2"]["high"] > 0.2  # Wilson at 0/10: [0, 0.28], not [0, 0]
    assert acc["full"]["low"] < 0.8 and acc["full"]["high"] == pytest.approx(1.0)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import eval_ruler

    for r in rows:
        r.update(side="kvlab", kind="full" if r["spec"] == "full" else "quant")
    table = eval_ruler.ranking_lines(rows, seed=0)
    ranked = [line.split(" | ")[3] for line in table[2:]]
    assert ranked == ["full", "h2o", "int2"]
    assert "lower" in table[3] and "lower" in table[4]  # h2o below full, int2 below h2o: intervals exclude 0
