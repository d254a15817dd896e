"""tighten: never slower, every sequence once, memory and GPUs respected; fixes the slow-group
cases it is for (free GPUs -> promote, a fast sibling -> merge, an unbalanced pair -> move)."""
import numpy as np
import pytest

from solver.tighten import tighten
from solver.types import DegreeCosts, GroupAssignment, group_times

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
