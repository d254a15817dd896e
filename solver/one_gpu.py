"""One GPU: the plan is a bin packing, and first-fit decreasing usually proves its own optimum.

With one GPU every micro-batch is a single degree-1 group, so a step takes the sum of its sequences'
times plus ``beta1`` per micro-batch, whatever the split: the best plan uses the fewest micro-batches
that hold every sequence within the group's token capacity. First-fit decreasing packs them in
O(n log n + n x bins); when it reaches the lower bound ``ceil(tokens / capacity)`` it is optimal and the
search has nothing to add (the planner of a one-GPU training run then keeps pace with small steps).
Otherwise ``None``: the full search runs as on any cluster.
"""
from __future__ import annotations

import math

import numpy as np

from .types import DegreeCosts, GroupAssignment, Schedule

MAX_SEQUENCES = 4096   # first-fit is O(n x bins) in Python: above this the search's own packing runs


def one_gpu_plan(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int) -> Schedule | None:
    """The optimal one-GPU plan when first-fit decreasing proves it, else None."""
    lengths = np.asarray(lengths)
    if num_gpus != 1 or costs.degrees[0] != 1 or not 0 < len(lengths) <= MAX_SEQUENCES:
        return None
    capacity = float(costs.capacity[0])
    if lengths.max() > capacity:
        return None                                   # infeasible: the search names it
    free: list[float] = []
    members: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        size = float(lengths[i])
        for b, room in enumerate(free):
            if size <= room:
                free[b] -= size
                members[b].append(i)
                break
        else:
            free.append(capacity - size)
            members.append([i])
    if len(members) > math.ceil(float(lengths.sum()) / capacity):
        return None
    return Schedule(tuple((GroupAssignment(1, np.array(sorted(ids), dtype=np.int64)),) for ids in members))
