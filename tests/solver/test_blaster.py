"""The blaster's splits: ``critical_fill``'s plain-Python loop (few micro-batches) makes the same choices
as its array form (many), ties included, and both respect memory."""
import numpy as np
import pytest

from solver import blaster


@pytest.mark.parametrize("seed", range(4))
def test_critical_fill_plain_and_array_forms_agree(seed):
    rng = np.random.default_rng(seed)
    for trial in range(150):
        n, num_mb = int(rng.integers(1, 120)), int(rng.integers(1, 12))
        critical, area = rng.random(n) * rng.choice([1.0, 0.01]), rng.random(n)
        if trial % 3 == 0:                    # coarse values: many ties on the rise and the load
            critical, area = np.round(critical, 1), np.round(area, 1)
        tokens = rng.integers(1, 100, n).astype(np.float64)
        order, limit = np.argsort(-tokens, kind="stable"), float(rng.integers(50, 2000))
        plain = blaster.critical_fill(order, area, critical, tokens, num_mb, 8, limit)
        arrays = blaster._critical_fill_arrays(order, area, critical, tokens, num_mb, 8, limit)
        assert (plain is None) == (arrays is None)
        if plain is not None:
            assert np.array_equal(plain, arrays)
            used = np.bincount(plain, weights=tokens, minlength=num_mb)
            assert (used <= limit).all()


def test_critical_fill_puts_long_sequences_together_and_fills_beside_them():
    # two long sequences share one critical path; the short ones fill the idle GPU-time beside them
    critical = np.array([1.0, 1.0, 0.1, 0.1, 0.1, 0.1])
    area = np.array([2.0, 2.0, 0.1, 0.1, 0.1, 0.1])
    tokens = np.ones(6)
    out = blaster.critical_fill(np.arange(6), area, critical, tokens, 2, 8, 10.0)
    assert out[0] == out[1]
    assert blaster.critical_fill(np.arange(6), area, critical, tokens, 2, 8, 2.0) is None   # 6 tokens, room for 4
