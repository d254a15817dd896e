"""tighten: never slower, every sequence once, memory and GPUs respected; fixes the slow-group
cases it is for (free GPUs -> promote, a fast sibling -> merge, an unbalanced pair -> move)."""
import numpy as np
import pytest

from solver.tighten import tighten, tighten_members
from solver.types import DegreeCosts, GroupAssignment, Groups, flat_ids, group_loads, group_times

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)


def check(before, after, lengths, num_gpus):
    ids = sorted(int(i) for g in after for i in g.seq_ids)
    assert ids == sorted(int(i) for g in before for i in g.seq_ids)
    assert sum(g.degree for g in after) <= num_gpus
    for g in after:
        assert lengths[g.seq_ids].sum() <= COSTS.capacity[COSTS.index(g.degree)]
    slow_before = group_times(before, lengths, COSTS).max()
    slow_after = group_times(after, lengths, COSTS).max()
    assert slow_after <= slow_before + 1e-12
    return slow_before, slow_after


def test_promotes_the_slowest_group_onto_free_gpus():
    lengths = np.array([100, 10, 10])
    before = (GroupAssignment(1, np.array([0])), GroupAssignment(1, np.array([1])), GroupAssignment(1, np.array([2])))
    after = tighten(before, lengths, COSTS, num_gpus=4)
    slow_before, slow_after = check(before, after, lengths, 4)
    assert slow_after < slow_before and any(g.degree == 2 and 0 in g.seq_ids for g in after)


def test_merges_a_slow_group_with_a_fast_sibling_when_no_gpu_is_free():
    lengths = np.array([100, 5])
    before = (GroupAssignment(1, np.array([0])), GroupAssignment(1, np.array([1])))
    after = tighten(before, lengths, COSTS, num_gpus=2)
    slow_before, slow_after = check(before, after, lengths, 2)
    assert slow_after < slow_before and len(after) == 1 and after[0].degree == 2


def test_moves_a_sequence_off_an_overloaded_group():
    lengths = np.array([40, 40, 40, 10])
    before = (GroupAssignment(2, np.array([0, 1, 2])), GroupAssignment(2, np.array([3])))
    after = tighten(before, lengths, COSTS, num_gpus=4)
    slow_before, slow_after = check(before, after, lengths, 4)
    assert slow_after < slow_before


@pytest.mark.parametrize("seed", range(30))
def test_random_micro_batches_stay_valid_and_never_slower(seed):
    rng = np.random.default_rng(seed)
    num_gpus = int(rng.choice([4, 8, 16]))
    groups, next_id, lengths, used = [], 0, [], 0
    while used < num_gpus:
        k = int(rng.integers(0, 4))
        d = COSTS.degrees[k]
        if used + d > num_gpus:
            break
        cap = COSTS.capacity[k]
        members = []
        room = cap
        for _ in range(int(rng.integers(1, 5))):
            s = int(rng.integers(1, max(2, room * 0.6)))
            if s > room:
                break
            members.append(next_id)
            lengths.append(s)
            next_id += 1
            room -= s
        if members:
            groups.append(GroupAssignment(d, np.array(members)))
            used += d
    if not groups:                       # the draw opened no group: one short sequence on one GPU
        groups, lengths = [GroupAssignment(1, np.array([0]))], [5]
    lengths = np.array(lengths)
    check(tuple(groups), tighten(tuple(groups), lengths, COSTS, num_gpus), lengths, num_gpus)


@pytest.mark.parametrize("seed", range(20))
def test_flat_groups_in_give_the_same_groups_out_as_a_list_and_merged_groups_leave(seed):
    """``tighten_members`` reads a micro-batch as one flat array (``Groups``) without splitting it: the
    same micro-batch given as a list of arrays tightens to the same groups, each sorted, and a group merged
    away is gone from ids, degrees and loads alike."""
    rng = np.random.default_rng(seed)
    n, num_groups = int(rng.integers(4, 40)), int(rng.integers(2, 9))
    lengths = rng.integers(1, 40, size=n)
    owner = np.concatenate([np.arange(num_groups), rng.integers(0, num_groups, size=n - num_groups)])
    members = [rng.permutation(np.flatnonzero(owner == g)) for g in range(num_groups)]
    deg = np.zeros(num_groups, dtype=np.int64)
    flat = Groups(np.concatenate(members), np.array([len(m) for m in members]))
    from_list = tighten_members(members, deg, lengths, COSTS, num_gpus=num_groups + 2, with_loads=True)
    from_flat = tighten_members(flat, deg, lengths, COSTS, num_gpus=num_groups + 2, with_loads=True)
    assert isinstance(from_flat[0], Groups) and len(from_flat[0]) == len(from_flat[1]) == len(from_flat[2])
    assert [g.tolist() for g in from_flat[0]] == [g.tolist() for g in from_list[0]]
    assert all(np.all(np.diff(g) > 0) for g in from_flat[0])
    assert np.array_equal(from_flat[1], from_list[1]) and np.array_equal(from_flat[2], from_list[2])
    assert np.allclose(from_flat[2], group_loads(from_flat[0], from_flat[1], lengths, COSTS))
    assert sorted(flat_ids(from_flat[0]).tolist()) == list(range(n))


RING_COSTS = DegreeCosts(degrees=(1, 2, 4, 8, 16), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7, 6e-8),
                         lin=(1e-3, 6e-4, 3.5e-4, 2e-4, 1.2e-4), capacity=(100.0, 200.0, 400.0, 800.0, 1600.0),
                         beta1=0.05, ring=(0.0, 0.0, 0.0, 2e-5, 3e-5), hops=(0.0, 0.0, 0.0, 1e-3, 2e-3))


@pytest.mark.parametrize("seed", range(60))
def test_compiled_steps_give_the_numpy_steps_groups(seed, monkeypatch):
    """``kernels.tighten_groups`` (numba, degrees that nest) against the numpy steps and the kernel interpreted:
    the same groups, degrees and loads bit for bit (both sum in order), with ring terms, repeated lengths (near
    ties) and groups that start empty."""
    from solver import kernels
    if not kernels.COMPILED:
        pytest.skip("numba not installed: only the numpy steps run")
    costs = RING_COSTS if seed % 2 else COSTS
    rng = np.random.default_rng(seed)
    n = int(rng.integers(12, 80))
    num_groups = int(rng.integers(2, 12))
    pool = rng.integers(1, 60, size=int(rng.integers(2, 8)))            # few distinct lengths: ties
    lengths = pool[rng.integers(0, len(pool), size=n)]
    owner = rng.integers(0, num_groups, size=n)
    members = [rng.permutation(np.flatnonzero(owner == g)) for g in range(num_groups)]   # some may be empty
    deg = rng.integers(0, 3, size=num_groups)
    num_gpus = int(np.asarray(costs.degrees)[deg].sum() + rng.integers(0, 6))
    compiled = tighten_members(members, deg, lengths, costs, num_gpus, with_loads=True)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "tighten_groups", kernels.tighten_groups.py_func)
        interpreted = tighten_members(members, deg, lengths, costs, num_gpus, with_loads=True)
    monkeypatch.setattr(kernels, "COMPILED", False)
    steps = tighten_members(members, deg, lengths, costs, num_gpus, with_loads=True)
    for other in (interpreted, steps):
        assert [g.tolist() for g in compiled[0]] == [g.tolist() for g in other[0]]
        assert np.array_equal(compiled[1], other[1]) and np.array_equal(compiled[2], other[2])
    assert sorted(flat_ids(compiled[0]).tolist()) == list(range(n))
    assert np.allclose(compiled[2], group_loads(compiled[0], compiled[1], lengths, costs), rtol=1e-12)


def test_read_only_lengths_compile_no_second_kernel():
    """Length arrays the project hands out read-only (``LengthDistribution.lengths``) reach ``tighten`` as they
    are; the kernel gets a fresh copy of the micro-batch's own, so nothing is compiled inside a plan's deadline."""
    from solver import kernels
    if not kernels.COMPILED:
        pytest.skip("numba not installed")
    lengths = np.array([60, 30, 10, 5, 40, 20], dtype=np.int64)
    lengths.flags.writeable = False
    members = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    kernels.warm()
    before = list(kernels.tighten_groups.signatures)
    got = tighten_members(members, np.zeros(3, dtype=np.int64), lengths, COSTS, num_gpus=5, with_loads=True)
    assert sorted(flat_ids(got[0]).tolist()) == list(range(6))
    assert list(kernels.tighten_groups.signatures) == before
