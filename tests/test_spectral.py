"""Curve analysis: exact regressions, spectra at known frequencies, aliasing, and the RoPE predictor."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.metrics import spectral as S
from kvlab.rope.ops import rotate
from kvlab.rope.spec import RopeSpec


def spec(
    head_dim: int = 64, theta: float = 1e5, rotary_dim: int | None = None, pairing: str = "half"
) -> RopeSpec:
    r = rotary_dim or head_dim
    inv = tuple(theta ** (-2 * i / r) for i in range(r // 2))
    return RopeSpec(inv_freq=inv, head_dim=head_dim, pairing=pairing, theta=theta)


def test_linear_fit_exact():
    x = np.arange(10.0)
    f = S.linear_fit(x, 2 * x + 1)
    assert f.slope == pytest.approx(2) and f.intercept == pytest.approx(1) and f.r2 == pytest.approx(1)
    assert S.r_squared(x, np.full_like(x, x.mean())) == pytest.approx(0)
    with pytest.raises(BadInputError):
        S.linear_fit(np.ones(5), x[:5])
    with pytest.raises(BadInputError):
        S.linear_fit(x[:2], x[:2])


def test_constant_offset_regression():
    ns = np.arange(1, 200.0)
    rng = np.random.default_rng(0)
    roll = 0.9 - 1e-4 * ns + 0.01 * np.sin(ns)
    trunc = roll - 0.2 + 0.001 * rng.standard_normal(ns.size)
    fits = S.roll_truncate_regression(ns, roll, trunc)
    assert fits["difference"].intercept == pytest.approx(0.2, abs=1e-3)
    assert abs(fits["difference"].slope) < 1e-5
    assert fits["roll"].slope == pytest.approx(-1e-4, rel=0.1)


def test_autocorrelation_and_spectrum_find_the_period():
    n = np.arange(256.0)
    y = 0.5 - 0.001 * n + 0.05 * np.cos(2 * math.pi * n / 8)
    ac = S.detrended_autocorrelation(y, max_lag=16)
    assert ac[0] == pytest.approx(1) and ac[8] > 0.8 and ac[4] < -0.8
    f, p = S.spectrum(y, step=1.0)
    assert f[np.argmax(p)] == pytest.approx(1 / 8, abs=1 / 256)
    assert f[-1] == pytest.approx(0.5)
    fs, ts, sp = S.spectrogram(y, window=32)
    assert sp.shape == (fs.size, ts.size) and fs[np.argmax(sp.mean(1))] == pytest.approx(1 / 8, abs=1 / 32)


def test_coarse_sampling_aliases_the_fastest_rope_period():
    rope = spec()
    fastest = min(rope.periods_tokens())
    assert fastest == pytest.approx(2 * math.pi)
    n5 = np.arange(0, 2000.0, 5)
    y = np.cos(2 * math.pi * n5 / fastest)
    f, p = S.spectrum(y, step=5.0)
    assert abs(f[np.argmax(p)] - 1 / fastest) > 0.05  # the true frequency is beyond Nyquist (0.1): aliased
    rep = S.aliasing_check(n5, rope)
    assert not rep.ok and rep.aliased_ranges == [(0.0, 1995.0, 5.0)] and "aliasing" in rep.message()
    mixed = np.concatenate([np.arange(0, 65), np.arange(96, 400, 32)])
    rep = S.aliasing_check(mixed, rope)
    assert rep.aliased_ranges[0][0] == 64 and S.aliasing_check(np.arange(65), rope).ok


@pytest.mark.parametrize("rotary_dim,pairing", [(None, "half"), (32, "half"), (None, "interleaved")])
def test_rope_predictor_is_exact_when_only_positions_change(rotary_dim, pairing):
    rope = spec(head_dim=64, rotary_dim=rotary_dim, pairing=pairing)
    torch.manual_seed(0)
    pre = torch.randn(3, 50, 64, dtype=torch.float64)  # [heads, slots, head_dim], pre-RoPE keys
    pos = torch.arange(100, 150)
    ns = np.array([1, 2, 3, 7, 20, 64, 500])
    energy = S.rope_pair_energy(pre, rope)
    assert energy.shape == (3, 50, 33 if rotary_dim is None else 17)
    np.testing.assert_allclose(energy.sum(-1), 1.0, atol=1e-12)
    predicted = S.predict_raw_cosine(energy, rope, ns)  # [3, 50, len(ns)]
    orig = rotate(pre, pos, rope)
    for j, n in enumerate(ns):
        moved = rotate(pre, pos - int(n), rope)
        measured = torch.nn.functional.cosine_similarity(orig, moved, dim=-1).numpy()
        np.testing.assert_allclose(predicted[..., j], measured, atol=1e-10)
    # Linear in the energy: the mean over slots predicts the mean cosine.
    np.testing.assert_allclose(S.predict_raw_cosine(energy.mean(1), rope, ns), predicted.mean(1), atol=1e-12)


def test_predictor_input_checks():
    rope = spec(head_dim=64)
    with pytest.raises(BadInputError):
        S.rope_pair_energy(torch.zeros(4, 32), rope)
    with pytest.raises(BadInputError):
        S.predict_raw_cosine(np.ones((2, 5)), rope, [1, 2])
    partial = dataclasses.replace(rope, inv_freq=rope.inv_freq[:8])
    assert S.rope_pair_energy(torch.ones(2, 64), partial).shape == (2, 9)
