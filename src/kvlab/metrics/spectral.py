"""Curve analysis for similarity-vs-roll curves: regression, autocorrelation, spectra, RoPE predictor.

A curve is ``y[j]`` measured at roll amounts ``ns[j]`` (tokens). Spectral tools need equally spaced
samples; their frequencies are in cycles per token so they can be laid over the model's RoPE
frequencies (``RopeSpec.frequencies_cycles_per_token()``). Sampling every ``s`` tokens only resolves
frequencies below ``1 / (2 s)``: RoPE's fastest pair has a period of 2*pi ~ 6.3 tokens, so a step of
5 (the thread's) aliases it; :func:`aliasing_check` says where.

The RoPE predictor (B3): if a roll changed nothing but positions, each rotary pair i of a key would
turn by ``n * w_i`` and the raw cosine between original and rolled key would be exactly
``sum_i E_i cos(n w_i) / sum_i E_i``, with ``E_i`` the energy of pair i of the de-rotated key (dims
beyond the rotary part count with ``w = 0``). :func:`predict_raw_cosine` evaluates that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvlab.errors import BadInputError
from kvlab.rope.spec import LayerRopes, Rope, RopeSpec


@dataclass(frozen=True)
class LinearFit:
    """``y ~ slope * x + intercept`` by least squares, with the coefficient of determination."""

    slope: float
    intercept: float
    r2: float
    n: int

    def to_json(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept, "r2": self.r2, "n": self.n}

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.slope * np.asarray(x, dtype=np.float64) + self.intercept


def _xy(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise BadInputError(f"x and y must be 1-D of equal length, got {x.shape} and {y.shape}")
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        raise BadInputError(f"need at least 3 finite points for a curve analysis, got {int(ok.sum())}")
    return x[ok], y[ok]


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    """``1 - SS_res / SS_tot`` (can be negative: a prediction worse than the measured mean)."""
    m, p = _xy(measured, predicted)
    ss_tot = float(((m - m.mean()) ** 2).sum())
    ss_res = float(((m - p) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else float("-inf"))


def linear_fit(x: np.ndarray, y: np.ndarray) -> LinearFit:
    """Least-squares line through ``(x, y)``; NaNs are dropped."""
    x, y = _xy(x, y)
    if np.ptp(x) == 0:
        raise BadInputError("x is constant; a slope is undefined")
    slope, intercept = np.polyfit(x, y, 1)
    return LinearFit(float(slope), float(intercept), r_squared(y, slope * x + intercept), int(x.size))


def roll_truncate_regression(ns: np.ndarray, roll: np.ndarray, truncate: np.ndarray) -> dict[str, LinearFit]:
    """Lines through the roll curve, the truncate curve and their difference (roll - truncate).

    The thread's claim "the roll-truncate gap is a constant offset" means: the difference has a slope
    near 0 and a line explains little of it (low R^2) while its mean is far from 0.
    """
    roll, truncate = np.asarray(roll, dtype=np.float64), np.asarray(truncate, dtype=np.float64)
    return {
        "roll": linear_fit(ns, roll),
        "truncate": linear_fit(ns, truncate),
        "difference": linear_fit(ns, roll - truncate),
    }


def detrend(y: np.ndarray) -> np.ndarray:
    """``y`` minus its least-squares line over 0..n-1."""
    y = np.asarray(y, dtype=np.float64)
    x = np.arange(y.size, dtype=np.float64)
    return y - linear_fit(x, y).predict(x)


def detrended_autocorrelation(y: np.ndarray, max_lag: int | None = None) -> np.ndarray:
    """Autocorrelation of the detrended curve at lags ``0..max_lag`` (lag 0 = 1); ``y`` equally spaced."""
    r = detrend(y)
    n = r.size
    max_lag = n - 1 if max_lag is None else max_lag
    if not 0 <= max_lag < n:
        raise BadInputError(f"max_lag must lie in [0, {n}), got {max_lag}")
    var = float((r**2).sum())
    if var == 0:
        return np.ones(max_lag + 1)
    return np.array([float((r[: n - k] * r[k:]).sum()) / var for k in range(max_lag + 1)])


def spectrum(y: np.ndarray, step: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Power spectrum of the detrended, Hann-windowed curve: ``(freq [cycles/token], power)``.

    ``y`` must be sampled every ``step`` tokens; frequencies run from 0 to the Nyquist ``1/(2 step)``.
    """
    if step <= 0:
        raise BadInputError(f"sampling step must be positive, got {step}")
    r = detrend(y)
    w = np.hanning(r.size)
    power = np.abs(np.fft.rfft(r * w)) ** 2 / max(float((w**2).sum()), 1e-12)
    return np.fft.rfftfreq(r.size, d=step), power


def spectrogram(
    y: np.ndarray, step: float = 1.0, window: int = 32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Short-time power spectrum of the detrended curve: ``(freq [cycles/token], centres [tokens], power [f, t])``."""
    from scipy.signal import spectrogram as _spectrogram

    r = detrend(y)
    if window < 4 or window > r.size:
        raise BadInputError(f"spectrogram window must lie in [4, {r.size}], got {window}")
    f, t, s = _spectrogram(r, fs=1.0 / step, nperseg=window, noverlap=window * 3 // 4, detrend="linear")
    return f, t, s


@dataclass(frozen=True)
class AliasingReport:
    """Where a sampling of roll amounts is too coarse for RoPE's fastest period."""

    fastest_period_tokens: float
    max_safe_step: float
    aliased_ranges: list[tuple[float, float, float]]  # (from n, to n, step)

    @property
    def ok(self) -> bool:
        return not self.aliased_ranges

    def message(self) -> str:
        if self.ok:
            return f"sampling resolves RoPE's fastest period ({self.fastest_period_tokens:.2f} tokens) everywhere"
        parts = ", ".join(f"n={a:g}..{b:g} (step {s:g})" for a, b, s in self.aliased_ranges)
        return (
            f"aliasing: steps above {self.max_safe_step:.2f} tokens (half of RoPE's fastest period "
            f"{self.fastest_period_tokens:.2f}) cannot resolve it at {parts}"
        )


def aliasing_check(ns: np.ndarray, rope: Rope) -> AliasingReport:
    """Flag every stretch of ``ns`` whose step exceeds half the fastest RoPE period (Nyquist; over every
    layer's RoPE for hybrid models)."""
    periods = [p for p in rope.periods_tokens() if np.isfinite(p)]
    if not periods:
        raise BadInputError("the RoPE spec has no finite period")
    fastest = min(periods)
    ns = np.sort(np.asarray(ns, dtype=np.float64))
    d = np.diff(ns)
    ranges: list[tuple[float, float, float]] = []
    for j, step in enumerate(d):
        if step > fastest / 2:
            if ranges and ranges[-1][1] == ns[j] and np.isclose(ranges[-1][2], step):
                ranges[-1] = (ranges[-1][0], float(ns[j + 1]), float(step))
            else:
                ranges.append((float(ns[j]), float(ns[j + 1]), float(step)))
    return AliasingReport(fastest, fastest / 2, ranges)


# -- B3: the RoPE predictor ---------------------------------------------------------------------


def rope_pair_energy(derotated_keys: torch.Tensor | np.ndarray, rope: Rope) -> np.ndarray:
    """Share of each key's squared norm in each rotary pair, ``[..., pairs + 1]`` (last: non-rotary dims).

    ``derotated_keys`` is ``[..., head_dim]`` (pre-RoPE keys); each row sums to 1. With one RoPE per
    layer (hybrid models) the keys' first axis indexes layers; a layer without RoPE puts all its
    energy in the last band (it never rotates, so it predicts an unchanged cosine).
    """
    raw = np.asarray(derotated_keys) if isinstance(derotated_keys, np.ndarray) else derotated_keys
    k = torch.as_tensor(raw, device="cpu").double()  # the shares come back as numpy: computed on the host
    if isinstance(rope, RopeSpec):
        return _pair_energy(k, rope)
    _check_layers(k.shape[0], rope)
    pairs = rope.rotary_dim // 2
    out = []
    for i, kl in enumerate(k):
        spec = rope.for_layer(i)
        if spec is None:
            e = torch.zeros((*kl.shape[:-1], pairs + 1), dtype=torch.float64, device="cpu")
            e[..., -1] = 1.0
            out.append(e.numpy())
        else:
            out.append(_pair_energy(kl, spec))
    return np.stack(out)


def _check_layers(n: int, rope: LayerRopes) -> None:
    if n != len(rope.layers):
        raise BadInputError(f"got {n} layers along the layer axis, the per-layer RoPE has {len(rope.layers)}")


def _pair_energy(k: torch.Tensor, rope: RopeSpec) -> np.ndarray:
    if k.shape[-1] != rope.head_dim:
        raise BadInputError(f"keys have head_dim {k.shape[-1]}, the RoPE spec expects {rope.head_dim}")
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    kr = k[..., :r]
    if rope.pairing == "half":
        pair = kr[..., :half] ** 2 + kr[..., half:] ** 2
    else:
        pair = kr[..., 0::2] ** 2 + kr[..., 1::2] ** 2
    rest = (k[..., r:] ** 2).sum(-1, keepdim=True)
    e = torch.cat((pair, rest), dim=-1)
    return (e / e.sum(-1, keepdim=True).clamp_min(1e-300)).numpy()


def predict_raw_cosine(energy: np.ndarray, rope: Rope, ns: np.ndarray, layer_axis: int = 0) -> np.ndarray:
    """Predicted raw key cosine after a shift of ``n`` tokens: ``sum_i E_i cos(n w_i)``, ``[..., len(ns)]``.

    ``energy`` is ``[..., pairs + 1]`` from :func:`rope_pair_energy` (averaged over slots as you like:
    the prediction is linear in it). Exact when the de-rotated keys do not change. With one RoPE per
    layer, ``layer_axis`` of ``energy`` indexes layers and each uses its own frequencies.
    """
    e = np.asarray(energy, dtype=np.float64)
    if isinstance(rope, RopeSpec):
        return _predict(e, rope.inv_freq, ns)
    e = np.moveaxis(e, layer_axis, 0)
    _check_layers(e.shape[0], rope)
    zeros = (0.0,) * (e.shape[-1] - 1)
    out = [
        _predict(el, s.inv_freq if (s := rope.for_layer(i)) is not None else zeros, ns)
        for i, el in enumerate(e)
    ]
    return np.moveaxis(np.stack(out), 0, layer_axis)


def _predict(e: np.ndarray, inv_freq: tuple[float, ...], ns: np.ndarray) -> np.ndarray:
    w = np.append(np.asarray(inv_freq, dtype=np.float64), 0.0)
    if e.shape[-1] != w.size:
        raise BadInputError(f"energy has {e.shape[-1]} bands, the RoPE spec {w.size} (pairs + non-rotary)")
    phase = np.cos(np.outer(w, np.asarray(ns, dtype=np.float64)))  # [bands, len(ns)]
    return e @ phase
