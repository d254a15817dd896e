"""``plan_batch``: the front door from a batch of lengths to a placed, validated ``Plan``.

It turns the cost model into per-degree numbers for the solver, runs a strategy, and places each
micro-batch's groups on aligned rank blocks: largest group first, each on the next free block of
its size, which always succeeds when the degrees sum to at most N (they are powers of two) and
keeps every group of at most a node's size inside one node.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Iterable

import numpy as np

from flexsp.errors import PlanError
from flexsp.plan import strategies as registry
from flexsp.plan.cluster import Cluster, aligned_block
from flexsp.plan.config import PlanConfig
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import as_lengths
from flexsp.plan.types import Group, MicroBatch, Plan
from solver.search import SearchOptions
from solver.types import Infeasible, InfeasibleDegree, Schedule


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


class TimeLimitWarning(UserWarning):
    """A strategy was still planning when ``time_limit`` passed: the wall-clock safety net cut its
    search, so the plan may differ on a faster or less loaded machine (searches are otherwise
    bounded in work and deterministic). Raise ``time_limit`` for a reproducible plan."""


_FROM_CONFIG: Any = object()   # plan_batch's strategy default: the config's (None is a bad name, not "unset")


def plan_batch(lengths: Iterable[int] | np.ndarray, cost: CostModel, cluster: Cluster, strategy: str = _FROM_CONFIG,
               *, config: PlanConfig | None = None, **settings: Any) -> Plan:
    """Plan one global batch: micro-batches of SP groups on ranks, with the predicted step time.

    ``config`` (a ``PlanConfig``) holds every planning setting; ``strategy`` and keyword ``settings``
    (``sp_degree=8``, ``time_limit=0.5``, ``degrees=(1, 8, 64)``, ...: ``PlanConfig``'s fields) override
    it for this call. ``strategy``: a name registered in ``flexsp.plan.strategies``
    (``describe_strategies()`` lists them): "flexsp" (heterogeneous groups, searched), "greedy" (the fast
    heuristic), "batchada" (best single degree for this batch), "static" (``sp_degree`` for every group,
    default the largest that fits the cluster), "dynamic-cp" (Megatron-style rule). ``time_limit``
    (wall-clock seconds) bounds every strategy: a first valid plan is built in one pass, everything
    after it runs only while time remains, and the best plan by then is returned; turning it into ranks
    and validating it comes on top (the constant past the limit, measured in
    ``experiments/scale_benchmark.py``). Searches are bounded in work, so a plan depends only on the
    inputs; ``time_limit`` is a safety net, and when it fires the plan says so (``meta["time_limit_hit"]``
    and a ``TimeLimitWarning``). ``degrees`` restricts every strategy to those SP degrees, which
    bounds the communicators each rank must hold (``flexsp.runtime.GroupPool(degrees=...)``). A degree
    above the cost model's Ulysses limit (its ``heads``) is a Ulysses x ring hybrid, recorded as
    ``Group.ring``; ``ulysses_only=True`` keeps every group within the limit.
    """
    started = time.perf_counter()
    lengths = as_lengths(lengths)
    config = config if config is not None else PlanConfig()
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config must be a flexsp.PlanConfig, got {type(config).__name__}")
    if strategy is not _FROM_CONFIG:
        settings["strategy"] = strategy
    config = (config.replace(**settings) if settings else config).checked(cost, cluster)
    costs = cost.degree_costs(cluster.usable_degrees(config.max_degree, config.degrees))   # CostModelError names a degree without bandwidth
    longest = int(lengths.argmax())
    if int(lengths[longest]) > cost.group_capacity(costs.degrees[-1]):      # integers: exact at any size
        raise PlanError(
            f"sequence {longest} has {int(lengths[longest])} tokens, more than the whole cluster can hold: "
            f"{costs.degrees[-1]} GPUs x {cost.token_capacity:.0f} tokens = {cost.group_capacity(costs.degrees[-1])}"
            + ("" if costs.degrees[-1] == cluster.degrees[-1] else " (largest allowed degree)"))
    options = SearchOptions(num_buckets=config.num_buckets)
    strategy = config.strategy
    try:
        schedule = registry.run_strategy(strategy, registry.PlanRequest(lengths, costs, cluster.num_gpus, options,
                                                                        started + config.time_limit, config.sp_degree))
    except (InfeasibleDegree, Infeasible) as exc:
        raise PlanError(f"{strategy}: {exc}") from None
    searched = time.perf_counter() - started
    hit = searched > config.time_limit
    if hit:
        warnings.warn(TimeLimitWarning(
            f"{strategy}: the time limit of {config.time_limit:g} s passed while planning ({searched:.2f} s); the "
            f"search was cut short and the plan may depend on machine load (raise time_limit to reproduce it)"),
            stacklevel=2)
    micro_batches = place(schedule, cost)
    plan = Plan(num_gpus=cluster.num_gpus, micro_batches=micro_batches,
                predicted_time=schedule.time(lengths, costs), strategy=strategy,
                gpus_per_node=cluster.gpus_per_node, solve_time=time.perf_counter() - started,
                meta={"time_limit_hit": True} if hit else {})
    if config.validate:
        plan.validate(lengths, cost, cluster)
    return plan


__all__ = ["plan_batch", "place", "TimeLimitWarning"]
