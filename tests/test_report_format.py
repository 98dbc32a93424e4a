"""The report's number formatting, headline helpers, glossary and legend check."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlab.metrics.stats import Interval  # noqa: E402
from kvlab.study.experiments import registry  # noqa: E402
from kvlab.study.report.format import dig, format_interval, format_range, iv, num  # noqa: E402
from kvlab.study.report.glossary import GLOSSARY, glossary_html  # noqa: E402


def legends_clipped(fig) -> list[str]:
    """Titles of the legends of ``fig`` that would not lie wholly inside its tight bounding box when
    saved with ``bbox_inches="tight"`` (an empty list means every legend is fully visible)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)  # inches
    dpi = fig.dpi
    x0, y0, x1, y1 = box.x0 * dpi, box.y0 * dpi, box.x1 * dpi, box.y1 * dpi
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    clipped = []
    for leg in legends:
        e = leg.get_window_extent(renderer)
        if e.x0 < x0 - 1 or e.y0 < y0 - 1 or e.x1 > x1 + 1 or e.y1 > y1 + 1:
            clipped.append(leg.get_title().get_text() or "legend")
    return clipped


def test_one_interval_format_for_every_shape():
    assert format_interval(0.99812, 0.99701, 0.99903) == "0.998 [0.997, 0.999]"
    assert format_interval(Interval(0.5, 0.25, 0.75, 8)) == "0.5 [0.25, 0.75] (n = 8)"
    assert format_interval({"value": 0.5, "low": None, "high": None, "n": 1}) == "0.5 (n = 1, no interval)"
    assert format_interval({"value": 46080, "low": None, "high": None}) == "46,080"
    assert format_interval(3.2e-5) == "3.20e-05"
    assert format_range([0.996, 0.996]) == "0.996" and format_range([10.9, 37.8]) == "10.9–37.8"


def test_dig_num_iv_follow_paths_and_keys_with_dots():
    s = {"a": {"b": {"value": 2.0, "low": 1.0, "high": 3.0}}, "roll: K orig@n.. + V": 1.5, "flag": True}
    assert dig(s, "a.b.value") == 2.0 and num(s, "a.b") == 2.0 and iv(s, "a.b") == "2 [1, 3]"
    assert num(s, "roll: K orig@n.. + V") == 1.5
    assert iv(s, "missing.path") == "–" and num(s, "missing") is None and iv(s, "flag") == "yes"


def test_every_study_experiment_writes_its_finding():
    missing = [e.name for e in registry().values() if e.in_study and e.describe is None]
    assert missing == []


def test_glossary_defines_the_labels_the_report_uses():
    terms = " ".join(t for t, _ in GLOSSARY)
    for label in (
        "the thread",
        "Phase 1",
        "sink",
        "KL",
        "interval",
        "paired difference",
        "cannot decide",
        "smoke run",
        "seed",
    ):
        assert label in terms or label in glossary_html()


@pytest.mark.parametrize("outside", [False, True])
def test_legend_check(tmp_path, outside):
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a rather long legend entry")
    if outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend()
    assert legends_clipped(fig) == []  # the tight box always grows to hold a legend
    fig.savefig(tmp_path / "f.png", bbox_inches="tight")  # as ExperimentContext.figure saves
    width = plt.imread(tmp_path / "f.png").shape[1]
    assert (width > 1.3 * fig.get_size_inches()[0] * fig.dpi) == outside  # the outside legend widened it
    plt.close(fig)


def test_prose_columns_are_left_aligned_and_numbers_right():
    from kvlab.study.experiments.base import ExperimentResult, Table
    from kvlab.study.report.html import render, section_data, tidy_table

    t = Table(
        "Claims checked",
        ["claim", "verdict", "measured", "n", "key [95% CI]", "Δ %"],
        [
            ["H2O is best at 50%", "holds", "H2O 0.61 vs 0.55", 12, "0.61 [0.4, 0.8] (n = 12)", "+1.5"],
            ["int4 costs nothing", "does not hold", "KL 0.02 nats", 3, "0.02 (n = 3, no interval)", "–"],
        ],
    )
    assert tidy_table(t)["prose"] == [True, True, True, False, False, False]
    result = ExperimentResult(name="x", title="x", description="")
    result.tables.append(t)
    page = render(
        "experiment",
        title="x",
        subtitle="x",
        s=section_data(result),
        smoke=False,
        glossary_items=[],
        manifest_line="",
    )
    assert '<td class="text">does not hold</td>' in page and '<td class="text">KL 0.02 nats</td>' in page
    assert "<td>0.02 (n = 3, no interval)</td>" in page and "<td>12</td>" in page
    assert '<th class="text">measured</th>' in page and "<th>n</th>" in page
    assert "th.text{text-align:left}" in page  # the header follows its column


def test_a_paired_difference_says_where_its_interval_lies():
    from kvlab.study.report.format import says, side_of_zero

    def d(low, high, n=8):
        return {"value": 0.1, "low": low, "high": high, "n": n}

    assert side_of_zero(d(0.05, 0.2)) == "above 0" and side_of_zero(d(-0.2, -0.05)) == "below 0"
    assert side_of_zero(d(0.0, 0.2)) == "contains 0"  # a bound at 0 does not exclude it
    assert (
        side_of_zero(d(None, None, 3)) == "n = 3, no interval" and side_of_zero(None) == "no common samples"
    )
    assert side_of_zero(d(float("nan"), 0.2)) == "n = 8, no interval"
    words = ("lower", "higher", "same", "too few")
    assert [says(x, *words) for x in (d(-0.2, -0.1), d(0.1, 0.2), d(-0.1, 0.1), d(None, None, 2))] == list(
        words
    )
