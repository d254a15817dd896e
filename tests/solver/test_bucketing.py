import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.bucketing import dp_buckets, exact_buckets, naive_buckets, token_error


def brute_force_error(lengths: np.ndarray, num_buckets: int) -> float:
    values = np.unique(lengths)
    best = np.inf
    for k in range(1, min(num_buckets, len(values)) + 1):
        for bounds in itertools.combinations(values[:-1], k - 1):
            upper = np.array(sorted(bounds) + [values[-1]])
            rounded = upper[np.searchsorted(upper, lengths)]
            best = min(best, (rounded - lengths).sum() / lengths.sum())
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=9), st.integers(1, 5))
def test_dp_matches_brute_force(values, num_buckets):
    lengths = np.array(values)
    buckets = dp_buckets(lengths, num_buckets)
    assert len(buckets.upper) <= num_buckets
    assert (buckets.rounded() >= lengths).all()
    assert abs(token_error(lengths, buckets) - brute_force_error(lengths, num_buckets)) < 1e-12


def test_dp_beats_naive_on_long_tails():
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(6, 1.5, size=2000)).astype(np.int64) + 1
    assert token_error(lengths, dp_buckets(lengths, 16)) < token_error(lengths, naive_buckets(lengths, 16)) / 3


def test_many_distinct_lengths_use_candidates_and_stay_valid():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 400_000, size=20_000)
    buckets = dp_buckets(lengths, 16)
    assert len(buckets.upper) <= 16 and buckets.upper[-1] == lengths.max()
    assert (buckets.rounded() >= lengths).all()
    assert token_error(lengths, buckets) < token_error(lengths, naive_buckets(lengths, 16))


def test_exact_buckets_round_nothing():
    lengths = np.array([5, 3, 5, 9])
    assert token_error(lengths, exact_buckets(lengths)) == 0.0


@pytest.mark.parametrize("seed", range(20))
def test_compiled_bucketing_dp_matches_numpys_bit_for_bit(seed):
    """``kernels.bucket_choices`` (numba) and ``bucket_choices_vectorised`` (numpy, what runs without numba):
    the same choices, ties and all, so the buckets never depend on whether numba is installed."""
    from solver import kernels
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 50 if seed % 2 else 5000, size=int(rng.integers(2, 400)))
    values, counts = np.unique(lengths, return_counts=True)
    u = len(values)
    v = values.astype(np.float64)
    w_cum = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
    s_cum = np.concatenate([[0.0], np.cumsum(counts * v)])
    j = np.arange(u)
    cost = v[None, :] * (w_cum[None, 1:] - w_cum[:u, None]) - (s_cum[None, 1:] - s_cum[:u, None])
    cost[j[:, None] > j[None, :]] = np.inf
    for num_buckets in (1, 2, 5, 16, u):
        assert np.array_equal(kernels.bucket_choices(cost, num_buckets),
                              kernels.bucket_choices_vectorised(cost, num_buckets))
