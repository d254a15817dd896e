"""``GroupColumns``: a micro-batch kept as columns reads, times and places exactly as the same groups
given as ``GroupAssignment`` tuples (the search hands its plans to the planner in this form)."""
import numpy as np
import pytest

from flexsp.plan.planner import place
from solver.materialize import as_groups
from solver.types import DegreeCosts, GroupColumns, Groups, Schedule

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)


def micro_batch(rng, ids: np.ndarray, num_gpus: int):
    """Random groups over ``ids`` on at most ``num_gpus`` GPUs: (each group's ids, degree indices)."""
    deg = []
    while sum(COSTS.degrees[k] for k in deg) < num_gpus and len(deg) < len(ids):
        k = int(rng.integers(0, 4))
        if sum(COSTS.degrees[j] for j in deg) + COSTS.degrees[k] <= num_gpus:
            deg.append(k)
        elif COSTS.degrees[0] + sum(COSTS.degrees[j] for j in deg) > num_gpus:
            break
    cuts = np.sort(rng.choice(np.arange(1, len(ids)), size=len(deg) - 1, replace=False)) if len(deg) > 1 else []
    return np.split(rng.permutation(ids), cuts), np.array(deg)


@pytest.mark.parametrize("seed", range(10))
def test_columns_read_time_and_place_as_the_same_groups_in_tuples(seed):
    rng = np.random.default_rng(seed)
    n, num_gpus = int(rng.integers(6, 60)), 8
    lengths = rng.integers(1, 90, size=n)
    parts = np.array_split(rng.permutation(n), int(rng.integers(1, 4)))
    batches = [micro_batch(rng, part, num_gpus) for part in parts]
    columns = Schedule(tuple(GroupColumns.of(Groups(np.concatenate(m), np.array([len(g) for g in m])), d, COSTS)
                             for m, d in batches))
    tuples = Schedule(tuple(as_groups(m, d, COSTS) for m, d in batches))
    for mb_columns, mb_tuples in zip(columns.micro_batches, tuples.micro_batches):
        assert len(mb_columns) == len(mb_tuples)
        assert [(g.degree, g.seq_ids.tolist()) for g in mb_columns] == [(g.degree, g.seq_ids.tolist()) for g in mb_tuples]
        assert mb_columns[-1].degree == mb_tuples[-1].degree
    assert columns.micro_batch_times(lengths, COSTS) == tuples.micro_batch_times(lengths, COSTS)
    assert columns.num_sequences == n
    assert place(columns) == place(tuples)
