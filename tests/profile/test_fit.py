"""Fits recover known coefficients; bad input fails with a message that says what is needed. No torch."""
import subprocess
import sys
import warnings

import numpy as np
import pytest

from flexsp import CostModelError
from flexsp.plan.memory import token_capacity
from flexsp.profile import MIN_COMM_POINTS, MIN_COMPUTE_POINTS, FitWarning, fit_bandwidth, fit_compute

TRUE = dict(alpha1=2e-7, alpha2=5e-5, beta1=5e-3)     # every term dominates somewhere in 64..16K tokens
LENGTHS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def _times(lengths, alpha1, alpha2, beta1):
    s = np.asarray(lengths, dtype=float)
    return alpha1 * s * s + alpha2 * s + beta1


def test_exact_data_gives_exact_coefficients():
    fit = fit_compute(LENGTHS, _times(LENGTHS, **TRUE))
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=1e-9)
    assert fit.max_abs_error < 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_noisy_data_recovers_coefficients(seed):
    # 2% multiplicative noise, 5 repeats per length, median per length. Each coefficient is pinned by
    # the points where its term dominates (beta1: 64-128 tokens; alpha2: ~256-1024; alpha1: 4K-16K),
    # each of those medians carries ~1% error, so 10% on every coefficient is several standard errors.
    rng = np.random.default_rng(seed)
    xs = np.repeat(LENGTHS, 5)
    ts = _times(xs, **TRUE) * rng.lognormal(0.0, 0.02, xs.size)
    fit = fit_compute(xs, ts)
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=0.10), name
    assert fit.max_abs_error < 0.05
    assert [p.x for p in fit.points] == LENGTHS        # one point per distinct length


def test_min_statistic_ignores_slow_repeats():
    xs = np.repeat(LENGTHS, 3)
    ts = _times(xs, **TRUE)
    ts[::3] *= 3.0   # one repeat in three hit by another process
    fit = fit_compute(xs, ts, statistic="min")
    assert fit.alpha1 == pytest.approx(TRUE["alpha1"], rel=1e-9)


def test_too_few_points_names_how_many():
    with pytest.raises(CostModelError, match=f"at least {MIN_COMPUTE_POINTS} distinct sequence lengths.*got 3"):
        fit_compute([128, 256, 512] * 4, _times([128, 256, 512] * 4, **TRUE))   # repeats are not new points
    with pytest.raises(CostModelError, match=f"at least {MIN_COMM_POINTS} distinct message sizes.*got 2"):
        fit_bandwidth(2, [1e6, 2e6], [1e-3, 2e-3])


def test_negative_coefficient_warns_or_raises():
    # Concave times: least squares wants alpha1 < 0; NNLS clamps it to 0 and says so.
    lengths = [100, 200, 400, 800, 1600]
    times = 1e-3 + 1e-4 * np.asarray(lengths) - 2e-8 * np.asarray(lengths) ** 2
    with pytest.warns(FitWarning, match="alpha1 fitted to 0.*longer sequences"):
        fit = fit_compute(lengths, times)
    assert fit.alpha1 == 0 and fit.alpha2 > 0
    with pytest.raises(CostModelError, match="alpha1 fitted to 0"):
        fit_compute(lengths, times, strict=True)


def test_times_that_do_not_grow_are_an_error():
    with pytest.raises(CostModelError, match="alpha1 = alpha2 = 0"):
        fit_compute([100, 200, 400, 800], [0.5, 0.5, 0.5, 0.5])
    with pytest.raises(CostModelError, match="does not grow with message size"):
        fit_bandwidth(4, [1e3, 1e4, 1e5], [1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("bad", [[0.1, -0.2, 0.3, 0.4], [0.1, float("nan"), 0.3, 0.4]])
def test_bad_times_are_named(bad):
    with pytest.raises(CostModelError, match="finite and > 0"):
        fit_compute([1, 2, 3, 4], bad)
    with pytest.raises(CostModelError, match="one time per point"):
        fit_compute([1, 2, 3], [0.1, 0.2])
    with pytest.raises(CostModelError, match="unknown statistic"):
        fit_compute([1, 2, 3, 4], [1, 2, 3, 4], statistic="mean")


def test_bandwidth_fit_recovers_latency_and_bandwidth():
    rng = np.random.default_rng(0)
    sizes = np.repeat([2**16, 2**18, 2**20, 2**22, 2**24], 4)
    times = (20e-6 + sizes / 50e9) * rng.lognormal(0, 0.02, sizes.size)
    fit = fit_bandwidth(8, sizes, times)
    assert fit.degree == 8
    assert fit.bandwidth == pytest.approx(50e9, rel=0.05)     # pinned by the big messages
    assert fit.latency == pytest.approx(20e-6, rel=0.10)      # pinned by the small ones


def test_token_capacity_formula_and_errors():
    assert token_capacity(80 * 2**30, 10 * 2**30, 2**20, usable_fraction=0.9) == int((72 - 10) * 2**30 // 2**20)
    with pytest.raises(CostModelError, match="model states leave no activation memory"):
        token_capacity(16 * 2**30, 20 * 2**30, 2**20)
    with pytest.raises(CostModelError, match="bytes per token must be > 0, got 0"):
        token_capacity(16 * 2**30, 0, 0)


def test_importing_flexsp_profile_does_not_import_torch():
    code = ("import sys, flexsp, flexsp.profile, flexsp.profile.cli, flexsp.profile.fit; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
