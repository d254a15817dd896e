"""``rebalance``'s two loops (plain Python on a few groups, numpy on many) give the same groups."""
import numpy as np
import pytest

from solver import materialize
from solver.types import DegreeCosts

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-9, 5e-10, 2.5e-10, 1.25e-10), lin=(1e-5, 6e-6, 3.5e-6, 2e-6),
                    capacity=(4000.0, 8000.0, 16000.0, 32000.0), beta1=0.01, ring=(0.0, 0.0, 1e-6, 1e-6),
                    hops=(0.0, 0.0, 1e-4, 2e-4))


@pytest.mark.parametrize("seed", range(30))
def test_plain_and_numpy_rebalance_give_the_same_groups(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    num_groups = int(rng.integers(1, 12))
    degree_idx = rng.integers(0, 4, size=num_groups)
    lengths = rng.integers(1, 6000, size=int(rng.integers(1, 60)))
    seq_ids = rng.permutation(len(lengths))[: int(rng.integers(1, len(lengths) + 1))]
    plain = materialize.rebalance(seq_ids, degree_idx, lengths, COSTS)
    monkeypatch.setattr(materialize, "PLAIN_REBALANCE_GROUPS", 0)
    vectorised = materialize.rebalance(seq_ids, degree_idx, lengths, COSTS)
    assert (plain is None) == (vectorised is None)
    if plain is not None:
        assert len(plain) == len(vectorised) == num_groups
        for a, b in zip(plain, vectorised):
            assert np.array_equal(a, b)
        assert sorted(np.concatenate(plain).tolist()) == sorted(seq_ids.tolist())
