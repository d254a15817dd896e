"""``plan_batch``: the front door from a batch of lengths to a placed, validated ``Plan``.

It turns the cost model into per-degree numbers for the solver, runs a strategy, and places each
micro-batch's groups on aligned rank blocks: largest group first, each on the next free block of
its size, which always succeeds when the degrees sum to at most N (they are powers of two) and
keeps every group of at most a node's size inside one node.
"""
from __future__ import annotations

import time
import warnings
from typing import Iterable

import numpy as np

from solver.search import SearchOptions
from solver.types import Infeasible, InfeasibleDegree, Schedule

from . import strategies as registry
from .arguments import check_plan_arguments
from .cluster import Cluster, aligned_block
from .cost import CostModel
from .errors import PlanError
from .plan import Group, MicroBatch, Plan


def usable_degrees(cluster: Cluster, max_degree: int | None = None,
                   degrees: Iterable[int] | None = None) -> tuple[int, ...]:
    """Deprecated: ``cluster.usable_degrees(max_degree, degrees)``."""
    warnings.warn("flexsp.planner.usable_degrees is deprecated; use Cluster.usable_degrees",
                  DeprecationWarning, stacklevel=2)
    return cluster.usable_degrees(max_degree, degrees)


def place(schedule: Schedule, cost: CostModel | None = None) -> tuple[MicroBatch, ...]:
    """Aligned rank blocks, largest group first: block ``[k*d, (k+1)*d)`` for a group of degree ``d``.
    With ``cost``, each group records its Ulysses x ring split."""
    micro_batches = []
    rings = {d: 1 if cost is None else cost.split(d)[1] for d in {g.degree for mb in schedule.micro_batches for g in mb}}
    for groups in schedule.micro_batches:
        offset, placed = 0, []
        for g in sorted(groups, key=lambda g: (-g.degree, int(g.seq_ids[0]) if len(g.seq_ids) else 0)):
            placed.append(Group(ranks=aligned_block(offset // g.degree, g.degree), seq_ids=tuple(g.seq_ids.tolist()),
                                ring=rings[g.degree]))
            offset += g.degree
        micro_batches.append(MicroBatch(tuple(placed)))
    return tuple(micro_batches)


def plan_batch(lengths: Iterable[int] | np.ndarray, cost: CostModel, cluster: Cluster, strategy: str = "flexsp", *,
               sp_degree: int | None = None, time_limit: float = 2.0, num_buckets: int = 16,
               max_degree: int | None = None, degrees: Iterable[int] | None = None, ulysses_only: bool = False,
               validate: bool = True) -> Plan:
    """Plan one global batch: micro-batches of SP groups on ranks, with the predicted step time.

    ``strategy``: a name registered in ``flexsp.strategies`` (``flexsp.strategies.describe_strategies()``
    lists them): "flexsp" (heterogeneous groups, searched), "greedy" (the fast heuristic),
    "batchada" (best single degree for this batch), "static" (``sp_degree`` for every group, default
    the largest that fits the cluster), "dynamic-cp" (Megatron-style rule). ``time_limit`` (wall-clock
    seconds) bounds every strategy: a first valid plan is built in one pass, everything after it
    runs only while time remains, and the best plan by then is returned; turning it into ranks and
    validating it comes on top (the constant past the limit, measured in
    ``experiments/scale_benchmark.py``). ``max_degree`` keeps groups at or below it;
    ``degrees`` (e.g. ``(1, 8, 64)``) restricts every strategy to those SP degrees, which bounds the
    communicators each rank must hold (``flexsp.runtime.GroupPool(degrees=...)``). A degree above the
    cost model's Ulysses limit (its ``heads``) is a Ulysses x ring hybrid, recorded as ``Group.ring``;
    ``ulysses_only=True`` keeps every group within the limit (the runtime runs only those today).
    """
    started = time.perf_counter()
    args = check_plan_arguments(lengths, cost, cluster, strategy, sp_degree=sp_degree, time_limit=time_limit,
                                num_buckets=num_buckets, max_degree=max_degree, degrees=degrees,
                                ulysses_only=ulysses_only, validate=validate)
    lengths, sp_degree, time_limit = args.lengths, args.sp_degree, args.time_limit
    costs = cost.degree_costs(cluster.usable_degrees(args.max_degree, args.degrees))   # CostModelError names a degree without bandwidth
    longest = int(lengths.argmax())
    if int(lengths[longest]) > cost.group_capacity(costs.degrees[-1]):      # integers: exact at any size
        raise PlanError(
            f"sequence {longest} has {int(lengths[longest])} tokens, more than the whole cluster can hold: "
            f"{costs.degrees[-1]} GPUs x {cost.token_capacity:.0f} tokens = {cost.group_capacity(costs.degrees[-1])}"
            + ("" if costs.degrees[-1] == cluster.degrees[-1] else " (largest allowed degree)"))
    options = SearchOptions(num_buckets=args.num_buckets, time_limit=time_limit)
    try:
        schedule = registry.run_strategy(strategy, registry.PlanRequest(lengths, costs, cluster.num_gpus, options,
                                                                        started + time_limit, sp_degree))
    except (InfeasibleDegree, Infeasible) as exc:
        raise PlanError(f"{strategy}: {exc}") from None
    micro_batches = place(schedule, cost)
    plan = Plan(num_gpus=cluster.num_gpus, micro_batches=micro_batches,
                predicted_time=schedule.time(lengths, costs), strategy=strategy,
                gpus_per_node=cluster.gpus_per_node, solve_time=time.perf_counter() - started)
    if validate:
        plan.validate(lengths, cost, cluster)
    return plan


def __getattr__(name: str):
    if name == "STRATEGIES":   # kept importable; the registry is the source
        return registry.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["plan_batch", "place", "STRATEGIES", "usable_degrees"]
