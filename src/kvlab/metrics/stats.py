"""Spread, not anecdotes: bootstrap confidence intervals for means and medians over prompts/windows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvlab.errors import BadInputError


@dataclass(frozen=True)
class Interval:
    """A statistic with its bootstrap interval, over ``n`` independent samples."""

    value: float
    low: float
    high: float
    n: int

    def to_json(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}

    def __str__(self) -> str:
        return f"{self.value:.4g} [{self.low:.4g}, {self.high:.4g}] (n={self.n})"


def bootstrap_ci(
    samples: np.ndarray | list[float],
    statistic: Callable[[np.ndarray], np.ndarray] | str = "mean",
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of ``statistic`` over the first axis of ``samples``.

    ``samples`` is ``[n]`` or ``[n, ...]`` (then the statistic is taken over axis 0 and the interval
    is of its mean over the remaining axes). NaNs are dropped.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim > 1:
        x = x.reshape(x.shape[0], -1).mean(axis=1)
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise BadInputError("no finite samples to bootstrap")
    if not 0 < confidence < 1:
        raise BadInputError(f"confidence must lie in (0, 1), got {confidence}")
    fn = (
        {"mean": np.mean, "median": np.median}.get(statistic, statistic)
        if isinstance(statistic, str)
        else statistic
    )
    if isinstance(fn, str):
        raise BadInputError(f"unknown statistic '{statistic}'")
    value = float(fn(x))
    if x.size == 1:
        return Interval(value, value, value, 1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    stats = np.apply_along_axis(fn, 1, x[idx]) if fn not in (np.mean, np.median) else fn(x[idx], axis=1)
    alpha = (1 - confidence) / 2
    return Interval(
        value, float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha)), int(x.size)
    )


def bootstrap_curve(
    samples: np.ndarray, *, confidence: float = 0.95, n_boot: int = 1000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean curve and pointwise bootstrap band of ``samples [n, points]`` (n windows/prompts).

    Returns ``(mean, low, high)``, each ``[points]``; NaNs are ignored per point.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise BadInputError(f"bootstrap_curve needs [n, points] samples, got shape {x.shape}")
    mean = np.nanmean(x, axis=0)
    if x.shape[0] == 1:
        return mean, mean.copy(), mean.copy()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(n_boot, x.shape[0]))
    boots = np.nanmean(x[idx], axis=1)  # [n_boot, points]
    alpha = (1 - confidence) / 2
    return mean, np.nanquantile(boots, alpha, axis=0), np.nanquantile(boots, 1 - alpha, axis=0)
