"""Single-degree baselines: ``static`` (one fixed degree) and ``batchada`` (best degree per batch).

Both pack with the same machinery so the comparison with FlexSP is about heterogeneity, not about a
weaker packer: the fewest micro-batches whose groups can hold every sequence (longest first, each to
the least-loaded group with room), then groups sorted by load and cut into micro-batches of
``N / d`` groups (or as many as ``d`` has tiles, for a degree that does not divide the nodes), which minimises the sum of per-micro-batch maxima for those groups.
"""
from __future__ import annotations

import time

import numpy as np

from .blaster import interleaved, min_micro_batches
from .counting import OutOfTime, search_count
from .types import DegreeCosts, GroupAssignment, InfeasibleDegree, Schedule, split_at

# Above this many sequences, a vectorised snake deal replaces the per-sequence LPT loop when it
# respects memory (with many sequences per group both balance to within one short sequence).
MAX_LPT_SEQUENCES = 16384


def _members(order: np.ndarray, owner: np.ndarray, num_groups: int) -> list[np.ndarray]:
    """Sequence ids of each group, ascending, from each sequence's group (``owner`` aligned with ``order``)."""
    members = order[np.lexsort((order, owner))]
    return split_at(members, np.bincount(owner, minlength=num_groups))


def _snake_groups(lengths: np.ndarray, capacity: float, num_groups: int) -> list[np.ndarray] | None:
    order = np.argsort(-lengths, kind="stable")
    lap, pos = np.divmod(np.arange(len(order)), num_groups)
    owner = np.where(lap % 2 == 0, pos, num_groups - 1 - pos)
    if (np.bincount(owner, weights=lengths[order], minlength=num_groups) > capacity).any():
        return None
    return _members(order, owner, num_groups)


def _lpt_groups(lengths: np.ndarray, times: np.ndarray, capacity: float, num_groups: int,
                deadline: float | None = None) -> list[np.ndarray] | None:
    """Longest first, each sequence to the least-loaded group with room (the blaster's interleaved
    split, with groups for micro-batches)."""
    if len(lengths) > MAX_LPT_SEQUENCES:
        snake = _snake_groups(lengths, capacity, num_groups)
        if snake is not None:
            return snake
    order = np.argsort(-lengths, kind="stable")
    owner = interleaved(order, times, lengths.astype(np.float64), num_groups, capacity, deadline)
    return None if owner is None else _members(order, owner[order], num_groups)


def single_degree(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, degree: int,
                  deadline: float | None = None) -> Schedule:
    """Every group of every micro-batch has ``degree`` GPUs.

    The micro-batch count is searched (galloping from the memory bound, then bisection), not
    stepped. Each count tries the vectorised snake deal first, then LPT while time remains: past
    ``deadline`` (``time.perf_counter()`` seconds) only the snake deal runs, O(sequences) per count,
    and one sequence per group (always fits) is the last resort."""
    k = costs.index(degree)
    capacity = costs.capacity[k]
    if lengths.max() > capacity:
        raise InfeasibleDegree(f"SP degree {degree} holds at most {capacity:.0f} tokens per group, "
                               f"but a sequence has {int(lengths.max())}")
    per_mb = costs.max_groups(k, num_gpus)               # N // d, or the tiles of d (non-power-of-two degrees)
    if per_mb < 1:
        raise InfeasibleDegree(f"SP degree {degree} is larger than the cluster ({num_gpus} GPUs)")
    times = costs.seq_time(lengths, k)
    lo = min_micro_batches(float(lengths.sum()), capacity * per_mb)
    hi = -(-len(lengths) // per_mb)                        # one sequence per group
    found: dict[int, list[np.ndarray]] = {}
    dealt: set[int] = set()                                # counts whose groups came from the snake deal

    def fits(num_mb: int) -> bool:
        if num_mb == hi:
            found[hi] = [np.array([i]) for i in range(len(lengths))]
            return True
        snake = _snake_groups(lengths, capacity, num_mb * per_mb)     # vectorised: tried first, even late
        if snake is not None:
            found[num_mb] = snake
            dealt.add(num_mb)
            return True
        if deadline is not None and time.perf_counter() > deadline:
            return False                                     # past the deadline: only the snake deal
        try:
            members = _lpt_groups(lengths, times, capacity, num_mb * per_mb, deadline)
        except OutOfTime:
            return False
        if members is not None:
            found[num_mb] = members
        return members is not None

    num_mb = search_count(fits, lo, hi)
    best = _schedule(found[num_mb], times, degree, per_mb)
    if num_mb in dealt and len(lengths) <= MAX_LPT_SEQUENCES:   # LPT balances better when it has time
        try:
            members = _lpt_groups(lengths, times, capacity, num_mb * per_mb, deadline)
        except OutOfTime:
            members = None
        if members is not None:
            lpt = _schedule(members, times, degree, per_mb)
            if sum(_mb_loads(lpt, times)) < sum(_mb_loads(best, times)):
                best = lpt
    return best


def _mb_loads(schedule: Schedule, times: np.ndarray) -> list[float]:
    return [max(float(times[g.seq_ids].sum()) for g in mb) for mb in schedule.micro_batches]


def _schedule(groups: list[np.ndarray], times: np.ndarray, degree: int, per_mb: int) -> Schedule:
    """Groups sorted by load, cut into micro-batches of ``per_mb``: minimises the sum of maxima."""
    members = [m for m in groups if len(m)]
    owner = np.repeat(np.arange(len(members)), [len(m) for m in members])
    loads = np.bincount(owner, weights=times[np.concatenate(members)], minlength=len(members))
    ranked = [members[j] for j in np.argsort(loads, kind="stable")[::-1]]
    return Schedule(tuple(
        tuple(GroupAssignment(degree, m) for m in ranked[i:i + per_mb])
        for i in range(0, len(ranked), per_mb)))


def _estimate(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, k: int) -> float:
    """A lower bound on a single-degree plan: its GPU-seconds spread over the cluster (a micro-batch takes at
    least its groups' mean load) plus beta1 for each micro-batch memory needs; orders the degrees so the
    likely best is planned first, and ends the search at the first degree it says cannot win."""
    per_mb = costs.max_groups(k, num_gpus)
    area = float(costs.seq_time(lengths, k).sum()) / per_mb
    return area + costs.beta1 * min_micro_batches(float(lengths.sum()), costs.capacity[k] * per_mb)


def batchada(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, deadline: float | None = None) -> Schedule:
    """The single degree with the shortest step for this batch. Degrees are planned most promising
    first, until one whose lower bound (``_estimate``) reaches the best plan so far; at ``deadline`` the
    best so far is returned (the first one always completes)."""
    feasible = [k for k, d in enumerate(costs.degrees) if d <= num_gpus and lengths.max() <= costs.capacity[k]]
    if not feasible:
        raise InfeasibleDegree("no single SP degree can hold the longest sequence")
    best, best_time = None, np.inf
    estimates = {k: _estimate(lengths, costs, num_gpus, k) for k in feasible}
    for k in sorted(feasible, key=estimates.__getitem__):
        if best is not None and deadline is not None and time.perf_counter() > deadline:
            break
        if estimates[k] > best_time * (1 + 1e-9):
            break   # a lower bound (the rest's are higher): no later degree can beat the best so far
        schedule = single_degree(lengths, costs, num_gpus, costs.degrees[k], deadline)
        t = schedule.time(lengths, costs)
        if t < best_time:
            best, best_time = schedule, t
    return best
