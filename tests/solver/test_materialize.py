"""``rebalance`` and ``fill_groups`` run ``solver.kernels``' loops (compiled by numba, or interpreted) and, without
numba on many groups, loops over numpy arrays: all give the same groups."""
import numpy as np
import pytest

from solver import kernels, materialize
from solver.group_packing import BinPacking
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
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "lpt_owners", getattr(kernels.lpt_owners, "py_func", kernels.lpt_owners))
        interpreted = materialize.rebalance(seq_ids, degree_idx, lengths, COSTS)
    monkeypatch.setattr(materialize, "PLAIN_MAX_GROUPS", 0)
    monkeypatch.setattr(kernels, "COMPILED", False)
    vectorised = materialize.rebalance(seq_ids, degree_idx, lengths, COSTS)
    assert (plain is None) == (interpreted is None)
    if plain is not None:
        assert all(np.array_equal(a, b) for a, b in zip(plain, interpreted))
    assert (plain is None) == (vectorised is None)
    if plain is not None:
        assert len(plain) == len(vectorised) == num_groups
        for a, b in zip(plain, vectorised):
            assert np.array_equal(a, b)
        assert sorted(np.concatenate(plain).tolist()) == sorted(seq_ids.tolist())


@pytest.mark.parametrize("seed", range(30))
def test_plain_and_numpy_dealing_give_the_same_groups_and_loads(seed, monkeypatch):
    """``fill_groups``: bucket counts per group dealt to real sequences, both loops alike."""
    rng = np.random.default_rng(seed)
    num_groups, num_buckets = int(rng.integers(1, 10)), int(rng.integers(1, 8))
    counts = rng.integers(0, 4, size=(num_groups, num_buckets)) * (rng.random((num_groups, num_buckets)) < 0.6)
    counts = np.repeat(counts, rng.integers(1, 4, size=num_groups), axis=0)    # runs of identical groups
    num_groups = len(counts)
    per_bucket = counts.sum(axis=0)
    bucket_of = np.repeat(np.arange(num_buckets), per_bucket)
    lengths = 500 * bucket_of + rng.integers(1, 500, size=len(bucket_of))     # longer buckets, longer sequences
    lengths[rng.random(len(lengths)) < 0.3] = 500 * bucket_of[:1].max(initial=0) + 7   # some equal lengths
    seq_ids = rng.permutation(len(lengths))
    packing = BinPacking(rng.integers(0, 4, size=num_groups), counts, makespan=0.0)
    plain, plain_load = materialize.fill_groups(packing, seq_ids, bucket_of, lengths, COSTS, with_loads=True)
    # the same groups as classes (runs of equal rows with a multiplicity): dealt as the expanded rows are
    runs = np.flatnonzero(np.r_[True, (np.diff(counts, axis=0) != 0).any(axis=1) | (np.diff(packing.degree_idx) != 0)])
    classes = BinPacking(packing.degree_idx[runs], counts[runs], makespan=0.0, mult=np.diff(np.r_[runs, num_groups]))
    assert np.array_equal(classes.expanded().counts, counts)
    as_classes, classes_load = materialize.fill_groups(classes, seq_ids, bucket_of, lengths, COSTS, with_loads=True)
    assert np.array_equal(plain.flat, as_classes.flat) and np.array_equal(plain_load, classes_load)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "deal_groups", getattr(kernels.deal_groups, "py_func", kernels.deal_groups))
        interpreted, interpreted_load = materialize.fill_groups(packing, seq_ids, bucket_of, lengths, COSTS,
                                                                with_loads=True)
    assert np.array_equal(plain.flat, interpreted.flat) and np.array_equal(plain_load, interpreted_load)
    monkeypatch.setattr(materialize, "PLAIN_MAX_GROUPS", 0)
    monkeypatch.setattr(kernels, "COMPILED", False)
    vectorised, load = materialize.fill_groups(packing, seq_ids, bucket_of, lengths, COSTS, with_loads=True)
    assert np.array_equal(plain.flat, vectorised.flat) and np.array_equal(plain.sizes, vectorised.sizes)
    assert np.array_equal(plain_load, load)
    assert np.array_equal(plain.sizes, counts.sum(axis=1))
