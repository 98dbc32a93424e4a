"""The few plotting moves every experiment's figures repeat: a figure, labelled axes, a band, error bars.

matplotlib is imported on first use, so listing or importing an experiment stays cheap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.metrics.stats import bootstrap_curve


def subplots(*args: Any, **kwargs: Any) -> Any:
    """``matplotlib.pyplot.subplots``: ``(fig, ax)`` or ``(fig, axes)``."""
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def colors() -> list[str]:
    """matplotlib's default colour cycle."""
    import matplotlib.pyplot as plt

    return plt.rcParams["axes.prop_cycle"].by_key()["color"]


def style(
    ax: Any,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    legend: float | None = 7,
    ncol: int = 1,
    **grid: Any,
) -> None:
    """Axis labels, a title, a light grid (``grid``: more of ``ax.grid``'s options) and a legend in
    ``legend``-point type with ``ncol`` columns (None: no legend)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    if legend is not None:
        ax.legend(fontsize=legend, ncol=ncol)


def plot_band(ax: Any, x: np.ndarray, samples: np.ndarray, label: str, **kw: Any) -> None:
    """A mean line with its bootstrap 95% band of ``samples [n, points]`` shaded in the line's colour."""
    mean, low, high = bootstrap_curve(samples)
    (line,) = ax.plot(x, mean, label=label, **kw)
    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.22, lw=0)


def shade(ax: Any, x: Any, samples: np.ndarray, color: Any, alpha: float = 0.2, **kw: Any) -> None:
    """The mean of ``samples [n, points]`` in ``color`` with its bootstrap 95% band at ``alpha``."""
    mean, lo, hi = bootstrap_curve(samples)
    ax.plot(x, mean, color=color, **kw)
    ax.fill_between(x, lo, hi, color=color, alpha=alpha)


def errorbars(ax: Any, x: Any, intervals: list, **kw: Any) -> None:
    """Points at the intervals' values with whiskers to their bounds (``Interval`` objects)."""
    ax.errorbar(
        x,
        [i.value for i in intervals],
        yerr=[[i.value - i.low for i in intervals], [i.high - i.value for i in intervals]],
        **kw,
    )
