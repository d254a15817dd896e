"""Single-degree baselines: ``static`` (one fixed degree) and ``batchada`` (best degree per batch).

Both pack with the same machinery so the comparison with FlexSP is about heterogeneity, not about a
weaker packer: the fewest micro-batches whose groups can hold every sequence (longest first, each to
the least-loaded group with room), then groups sorted by load and cut into micro-batches of
``N / d`` groups, which minimises the sum of per-micro-batch maxima for those groups.
"""
from __future__ import annotations

import numpy as np

from .blaster import interleaved, min_micro_batches
from .costs import DegreeCosts
from .schedule import GroupAssignment, Schedule


class InfeasibleDegree(ValueError):
    """A sequence is longer than one group of this degree can hold."""


# Above this many sequences, a vectorised snake deal replaces the per-sequence LPT loop when it
# respects memory (with many sequences per group both balance to within one short sequence).
MAX_LPT_SEQUENCES = 16384


def _members(order: np.ndarray, owner: np.ndarray, num_groups: int) -> list[np.ndarray]:
    """Sequence ids of each group, from each sequence's group (``owner`` aligned with ``order``)."""
    members = order[np.argsort(owner, kind="stable")]
    return np.split(members, np.cumsum(np.bincount(owner, minlength=num_groups))[:-1])


def _snake_groups(lengths: np.ndarray, capacity: float, num_groups: int) -> list[np.ndarray] | None:
    order = np.argsort(-lengths, kind="stable")
    lap, pos = np.divmod(np.arange(len(order)), num_groups)
    owner = np.where(lap % 2 == 0, pos, num_groups - 1 - pos)
    if (np.bincount(owner, weights=lengths[order], minlength=num_groups) > capacity).any():
        return None
    return _members(order, owner, num_groups)


def _lpt_groups(lengths: np.ndarray, times: np.ndarray, capacity: float, num_groups: int) -> list[np.ndarray] | None:
    """Longest first, each sequence to the least-loaded group with room (the blaster's interleaved
    split, with groups for micro-batches)."""
    if len(lengths) > MAX_LPT_SEQUENCES:
        snake = _snake_groups(lengths, capacity, num_groups)
        if snake is not None:
            return snake
    order = np.argsort(-lengths, kind="stable")
    owner = interleaved(order, times, lengths.astype(np.float64), num_groups, capacity)
    return None if owner is None else _members(order, owner[order], num_groups)


def single_degree(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, degree: int) -> Schedule:
    """Every group of every micro-batch has ``degree`` GPUs."""
    k = costs.index(degree)
    capacity = costs.capacity[k]
    if lengths.max() > capacity:
        raise InfeasibleDegree(f"SP degree {degree} holds at most {capacity:.0f} tokens per group, "
                               f"but a sequence has {int(lengths.max())}")
    per_mb = num_gpus // degree
    if per_mb < 1:
        raise InfeasibleDegree(f"SP degree {degree} is larger than the cluster ({num_gpus} GPUs)")
    times = costs.seq_time(lengths, k)
    num_mb = min_micro_batches(float(lengths.sum()), capacity * per_mb)
    while True:
        members = _lpt_groups(lengths, times, capacity, num_mb * per_mb)
        if members is not None:
            break
        num_mb += 1
    members = [m for m in members if len(m)]
    loads = [times[m].sum() for m in members]
    ranked = [members[j] for j in np.argsort(loads, kind="stable")[::-1]]
    micro_batches = tuple(
        tuple(GroupAssignment(degree, np.sort(m)) for m in ranked[i:i + per_mb])
        for i in range(0, len(ranked), per_mb))
    return Schedule(micro_batches)


def batchada(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int) -> Schedule:
    """The single degree with the shortest step for this batch."""
    best, best_time = None, np.inf
    for degree in costs.degrees:
        if degree > num_gpus:
            continue
        try:
            schedule = single_degree(lengths, costs, num_gpus, degree)
        except InfeasibleDegree:
            continue
        t = schedule.time(lengths, costs)
        if t < best_time:
            best, best_time = schedule, t
    if best is None:
        raise InfeasibleDegree("no single SP degree can hold the longest sequence")
    return best
