"""Spread, not anecdotes: confidence intervals for means and medians over prompts/text samples, and
for proportions.

Means and medians get a percentile bootstrap (:func:`scipy.stats.bootstrap`, seeded); proportions (shares
in [0, 1]: accuracies, agreement rates, hit rates) get a Wilson score interval (:func:`wilson_ci`), which
stays honest at 0/n and n/n where a bootstrap collapses to ``[1, 1]``. An interval needs at least
:data:`MIN_SAMPLES` samples: fewer have a value and no interval (``low`` and ``high`` are NaN, written as
``null`` in JSON and as "n = 2, no interval" in the report), never a ``[v, v]`` that looks like
certainty; so do bounds that come out non-finite.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvlab.errors import BadInputError

#: the fewest independent samples an interval may rest on (fewer: the value alone, with its n)
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Interval:
    """A statistic with its interval, over ``n`` independent samples (``low``/``high`` are NaN when
    ``n`` < :data:`MIN_SAMPLES` or the bounds are not finite: a value without an interval)."""

    value: float
    low: float
    high: float
    n: int

    @property
    def has_interval(self) -> bool:
        return self.n >= MIN_SAMPLES and math.isfinite(self.low) and math.isfinite(self.high)

    def to_json(self) -> dict:
        ok = self.has_interval
        return {
            "value": self.value,
            "low": self.low if ok else None,
            "high": self.high if ok else None,
            "n": self.n,
        }

    def bracket(self, fmt: str = ".3g") -> str:
        """``[low, high]``, or ``(n = 2, no interval)`` when there is none."""
        if not self.has_interval:
            return f"(n = {self.n}, no interval)"
        return f"[{self.low:{fmt}}, {self.high:{fmt}}]"

    def text(self, fmt: str = ".3g") -> str:
        """``value [low, high]`` (or the value and why there is no interval)."""
        return f"{self.value:{fmt}} {self.bracket(fmt)}"

    def __str__(self) -> str:
        return f"{self.text('.4g')} (n={self.n})" if self.has_interval else self.text(".4g")


def _statistic(statistic: Callable[..., np.ndarray] | str) -> Callable[..., np.ndarray]:
    if isinstance(statistic, str):
        named: dict[str, Callable[..., np.ndarray]] = {"mean": np.mean, "median": np.median}
        fn = named.get(statistic)
        if fn is None:
            raise BadInputError(f"unknown statistic '{statistic}'")
        return fn
    return statistic


def _percentile_bootstrap(
    x: np.ndarray, fn: Callable[..., np.ndarray], confidence: float, n_boot: int, seed: int
) -> tuple[float, float]:
    """``scipy.stats.bootstrap`` (percentile) of ``fn`` over axis 0 of ``x``; NaN bounds where every
    resample gives the same value (scipy's degenerate case) are that value."""
    from scipy import stats

    vectorized = fn in (np.mean, np.median, np.nanmean, np.nanmedian)
    res = stats.bootstrap(
        (x,),
        fn if vectorized else (lambda s, axis=-1: np.apply_along_axis(fn, axis, s)),
        confidence_level=confidence,
        n_resamples=n_boot,
        method="percentile",
        vectorized=True,
        axis=0,
        rng=np.random.default_rng(seed),
    )
    return res.confidence_interval.low, res.confidence_interval.high


def bootstrap_ci(
    samples: np.ndarray | list[float],
    statistic: Callable[[np.ndarray], np.ndarray] | str = "mean",
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of ``statistic`` over the first axis of ``samples``
    (:func:`scipy.stats.bootstrap`).

    ``samples`` is ``[n]`` or ``[n, ...]`` (then each sample is first averaged over its remaining axes).
    NaNs are dropped. Fewer than :data:`MIN_SAMPLES` finite samples give the value and no interval (NaN
    bounds). For a proportion use :func:`wilson_ci`.
    """
    x = _finite_samples(samples, confidence)
    fn = _statistic(statistic)
    value = float(fn(x))
    if x.size < MIN_SAMPLES:
        return Interval(value, math.nan, math.nan, int(x.size))
    if np.all(x == x[0]):  # every resample is the same: the interval is that value, over n samples
        return Interval(value, value, value, int(x.size))
    low, high = _percentile_bootstrap(x, fn, confidence, n_boot, seed)
    if not (math.isfinite(low) and math.isfinite(high)):
        return Interval(value, math.nan, math.nan, int(x.size))
    return Interval(value, float(low), float(high), int(x.size))


def _finite_samples(samples: np.ndarray | list[float], confidence: float) -> np.ndarray:
    """``samples`` as a 1-D float64 array of its finite values (a sample ``[...]`` is first averaged)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim > 1:
        x = x.reshape(x.shape[0], -1).mean(axis=1)
    x = x[np.isfinite(x)]
    if x.size == 0:
        raise BadInputError("no finite samples for an interval")
    if not 0 < confidence < 1:
        raise BadInputError(f"confidence must lie in (0, 1), got {confidence}")
    return x


def wilson_ci(samples: np.ndarray | list[float], *, confidence: float = 0.95) -> Interval:
    """Wilson score interval of a proportion: the mean of ``samples``, each a share in [0, 1].

    A sample is one 0/1 outcome (a trial found the needle or not) or one independent unit's own share (a
    text sample's top-1 agreement over its tokens); ``[n, ...]`` samples are first averaged per sample.
    For 0/1 outcomes this is the textbook Wilson interval for k successes in n; for shares it is
    conservative (a share's variance is at most p(1 - p)). At 0/n and n/n it keeps its width (0/10:
    [0, 0.28]), where a bootstrap collapses to ``[0, 0]``. NaNs are dropped; fewer than
    :data:`MIN_SAMPLES` samples give the value and no interval.
    """
    from statistics import NormalDist

    x = _finite_samples(samples, confidence)
    if np.any((x < 0) | (x > 1)):
        raise BadInputError("a proportion's samples must lie in [0, 1]")
    p, n = float(x.mean()), int(x.size)
    if n < MIN_SAMPLES:
        return Interval(p, math.nan, math.nan, n)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the interval holds p (exactly: at 0/n its low end is 0, at n/n its high end 1); float rounding of
    # centre -/+ half can land an ulp on the wrong side of p, which a bar's error (p - low) would turn negative
    return Interval(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)), n)


def bootstrap_curve(
    samples: np.ndarray, *, confidence: float = 0.95, n_boot: int = 1000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean curve and pointwise bootstrap band of ``samples [n, points]`` (n text samples/prompts).

    Returns ``(mean, low, high)``, each ``[points]``; NaNs are ignored per point. With fewer than
    :data:`MIN_SAMPLES` samples the band is NaN (no band is drawn): such a curve has no interval.
    """
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise BadInputError(f"bootstrap_curve needs [n, points] samples, got shape {x.shape}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN point stays NaN
        mean = np.nanmean(x, axis=0)
    if x.shape[0] < MIN_SAMPLES:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan.copy()
    # Resample rows (windows), keeping each window's curve whole: one index draw for every point.
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.shape[0], size=(n_boot, x.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        boots = np.nanmean(x[idx], axis=1)  # [n_boot, points]
        alpha = (1 - confidence) / 2
        return mean, np.nanquantile(boots, alpha, axis=0), np.nanquantile(boots, 1 - alpha, axis=0)


def paired_share_ci(
    a: np.ndarray | list[float], b: np.ndarray | list[float], *, confidence: float = 0.95
) -> Interval:
    """Interval of ``mean(a) - mean(b)`` over paired shares in [0, 1] (the same trials scored by two caches):
    Tango's score interval for paired proportions (Tango 1998, *Stat. Med.* 17:891).

    For 0/1 scores it is Tango's interval on the discordant counts ``b10`` (a right, b wrong) and ``b01``.
    Scores with partial credit are first put on an effective sample, as Korn and Graubard do for complex
    surveys: the counts are the summed positive and negative parts of the differences, all scaled by
    ``1 / rho`` with ``rho = sum(d**2) / sum(|d|)`` (1 for 0/1 scores), which gives the interval the
    differences' own variance at the estimate. Unlike a bootstrap of the differences it keeps its width when
    every pair ties (40 tied pairs: ``0 [-0.088, +0.088]``, not ``[0, 0]``) or nearly so. Pairs with a NaN on
    either side are dropped; fewer than :data:`MIN_SAMPLES` pairs give the value and no interval.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise BadInputError(f"paired shares need two [n] arrays of one length, got {x.shape} and {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y)
    d = x[keep] - y[keep]
    if d.size == 0:
        raise BadInputError("no finite pairs for an interval")
    if np.any((x[keep] < 0) | (x[keep] > 1) | (y[keep] < 0) | (y[keep] > 1)):
        raise BadInputError("paired shares must lie in [0, 1]")
    n, value = int(d.size), float(d.mean())
    if n < MIN_SAMPLES:
        return Interval(value, math.nan, math.nan, n)
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    moved = float(np.abs(d).sum())
    scale = moved / float((d * d).sum()) if moved > 0 else 1.0  # 1 / rho: the effective sample's size over n
    b10, b01 = float(d.clip(min=0).sum()) * scale, float((-d).clip(min=0).sum()) * scale
    return Interval(
        value, _tango_bound(b10, b01, n * scale, z, -1.0), _tango_bound(b10, b01, n * scale, z, 1.0), n
    )


def _tango_score(b10: float, b01: float, n: float, delta: float) -> float:
    """Tango's score statistic for the paired difference ``delta``: decreasing in ``delta``."""
    w = delta * (2 * n - b10 + b01) - (b10 + b01)
    q01 = (math.sqrt(max(w * w + 8 * n * b01 * delta * (1 - delta), 0.0)) - w) / (4 * n)  # constrained MLE
    var = n * (2 * q01 + delta * (1 - delta))
    return (
        (b10 - b01 - n * delta) / math.sqrt(var)
        if var > 0
        else math.copysign(math.inf, b10 - b01 - n * delta)
    )


def _tango_bound(b10: float, b01: float, n: float, z: float, side: float) -> float:
    """The interval's bound on ``side`` (-1 lower, +1 upper): where the score crosses ``-side * z`` (bisection)."""
    lo, hi = ((b10 - b01) / n, side) if side > 0 else (side, (b10 - b01) / n)
    for _ in range(100):
        mid = (lo + hi) / 2
        beyond = _tango_score(b10, b01, n, mid) < -z if side > 0 else _tango_score(b10, b01, n, mid) > z
        lo, hi = (lo, mid) if beyond == (side > 0) else (mid, hi)
    return (lo + hi) / 2
