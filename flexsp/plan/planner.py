"""``plan_batch``: the front door from a batch of lengths to a placed, validated ``Plan``.

It turns the cost model into per-degree numbers for the solver, runs a strategy, and places each
micro-batch's groups on tiles (``flexsp.plan.cluster.place_groups``): largest group first, each on the
lowest free tile of its degree, inside one node or on whole nodes. For degrees that nest (powers of
two, the default) that always succeeds when the degrees sum to at most N, and the tiles are the
aligned blocks ``[k*d, (k+1)*d)``. For other sets (``degrees="any"``, ``(1, 2, 3, 6, 12)``) the solver's
packer checks placement itself (``DegreeCosts.placeable``); a micro-batch a strategy still returns
unplaceable (a strategy that counts GPUs only) is repaired: the groups without a tile move to extra
micro-batches, and when that happens the strategy's candidates (flexsp: batchada, dynamic-cp) and the
same strategy on the nesting subset of the degrees also plan, and the fastest placed plan wins, so a
non-power-of-two set never loses to its nesting part by repair. A set with no nesting part at all
(``(3,)``, ``(3, 6)`` on nodes of 8) is planned with exactly the degrees given.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import warnings
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from flexsp.errors import PlanError
from flexsp.plan import strategies as registry
from flexsp.plan.cluster import Cluster, Placement, nesting_subset, place_groups, place_partial, places
from flexsp.plan.config import PlanConfig
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import as_lengths
from flexsp.plan.types import MicroBatch, PlacedGroups, Plan, per_degree
from solver.search import SearchOptions
from solver.types import DegreeCosts, GroupAssignment, GroupColumns, Infeasible, InfeasibleDegree, Schedule


def _ordered(groups) -> list[GroupAssignment]:
    """``groups`` in ``placement_order``."""
    groups = list(groups)
    if len(groups) < 2:
        return groups
    degrees = np.fromiter((g.degree for g in groups), dtype=np.int64, count=len(groups))
    first = np.fromiter((g.seq_ids[0] if len(g.seq_ids) else 0 for g in groups), dtype=np.int64, count=len(groups))
    return [groups[i] for i in placement_order(degrees, first).tolist()]


def placement_order(degrees: np.ndarray, first_ids: np.ndarray) -> np.ndarray:
    """The order groups are placed and listed in: largest first, then by first sequence id (0 for none)."""
    return np.lexsort((first_ids, -degrees))


def place(schedule: Schedule, cost: CostModel | None = None, cluster: Cluster | None = None) -> tuple[MicroBatch, ...]:
    """Each micro-batch's groups on tiles (``place_groups``; default cluster: one node of N GPUs, where
    powers of two land on the aligned blocks ``[k*d, (k+1)*d)``), in ``placement_order``. With ``cost``,
    each group records its Ulysses x ring split. A ``PlanError`` if a micro-batch does not place (``repair``
    first). Works on arrays per micro-batch and returns the groups as ``PlacedGroups`` (columns that read as
    ``Group`` tuples, built on first access): a 16,384-GPU plan has 131,072 groups."""
    n = schedule_gpus(schedule) if cluster is None else cluster.num_gpus
    per_node = n if cluster is None else cluster.gpus_per_node
    micro_batches = []
    ring_of = (lambda d: 1) if cost is None else (lambda d: cost.split(d)[1])   # each degree's ring axis
    for m, groups in enumerate(schedule.micro_batches):
        count = len(groups)
        if isinstance(groups, GroupColumns):                    # the search's micro-batches: read the columns
            degrees, sizes, flat = groups.degrees, groups.ids.sizes, groups.ids.flat.astype(np.int64)
        else:
            degrees = np.fromiter(map(_degree, groups), dtype=np.int64, count=count)
            members = list(map(_seq_ids, groups))
            sizes = np.fromiter(map(len, members), dtype=np.int64, count=count)
            flat = np.concatenate(members).astype(np.int64) if count else np.zeros(0, dtype=np.int64)
        offsets = np.cumsum(sizes) - sizes
        first = np.where(sizes > 0, flat[np.minimum(offsets, max(0, len(flat) - 1))] if len(flat) else 0, 0)
        order = placement_order(degrees, first)
        degrees, sizes, offsets = degrees[order], sizes[order], offsets[order]
        starts = place_groups(degrees.tolist(), n, per_node)
        if starts is None:
            raise PlanError(f"micro-batch {m}: groups of degrees {degrees.tolist()} do not place on "
                            f"{n} GPUs in nodes of {per_node}")
        ends = np.cumsum(sizes)
        ids = flat[np.repeat(offsets - (ends - sizes), sizes) + np.arange(len(flat))]
        ring = per_degree(degrees, ring_of, np.int64)
        micro_batches.append(MicroBatch(PlacedGroups(starts, degrees, ring, ids, sizes)))
    return tuple(micro_batches)


_degree, _seq_ids = attrgetter("degree"), attrgetter("seq_ids")


def schedule_gpus(schedule: Schedule) -> int:
    """GPUs the busiest micro-batch of ``schedule`` uses."""
    return max((sum(g.degree for g in mb) for mb in schedule.micro_batches), default=1)


def repair(schedule: Schedule, cluster: Cluster, lengths: np.ndarray, costs: DegreeCosts) -> tuple[Schedule, int]:
    """``schedule`` with every micro-batch placeable, and how many groups moved.

    In a micro-batch that does not place, the groups left without a tile (``place_partial``: largest
    first, lowest free tile) are taken out and, slowest first, each put where it adds the least step
    time: into any micro-batch (its own included) at any degree that holds its tokens and still
    places there (``places``), or into a new micro-batch of its own. Candidates are tried cheapest
    first, so each group costs a sort of (micro-batches x degrees) numbers and a few placement checks.
    A group always places alone, so this ends; for nesting degrees nothing moves."""
    n, per_node = cluster.num_gpus, cluster.gpus_per_node
    kept: list[list[GroupAssignment]] = []
    moved: list[GroupAssignment] = []
    for groups in schedule.micro_batches:
        ordered = _ordered(groups)
        starts = place_partial([x.degree for x in ordered], n, per_node)
        kept.append([x for x, s in zip(ordered, starts) if s >= 0])
        moved += [x for x, s in zip(ordered, starts) if s < 0]
    if not moved:
        return schedule, 0
    degrees = np.asarray(costs.degrees)
    index = {int(d): k for k, d in enumerate(degrees)}
    counts = np.zeros((len(kept), len(degrees)), dtype=np.int64)
    span = np.zeros(len(kept))
    for m, mb in enumerate(kept):
        for x in mb:
            counts[m, index[x.degree]] += 1
        span[m] = max((x.time(lengths, costs) for x in mb), default=0.0)

    def group_times(x: GroupAssignment) -> np.ndarray:          # [D] seconds at every degree; inf: no room
        tokens = float(lengths[x.seq_ids].sum())
        t = costs.times(lengths[x.seq_ids]).sum(axis=0) + costs.beta1
        return np.where(tokens <= np.asarray(costs.capacity), t, np.inf)

    # (micro-batch, degree) pairs found full: a micro-batch only gains groups here, and a group more never
    # helps a placement, so each pair is checked until it fails once (at most M x D failed checks in all,
    # not one per moved group: 244 moved groups on 30 GPUs took 5 s of checks without this)
    full = np.zeros(counts.shape, dtype=bool)
    timed = sorted(((group_times(x), x) for x in moved), key=lambda p: -float(p[0][index[p[1].degree]]))
    for times, x in timed:
        extra = np.maximum(times[None, :] - span[:, None], 0.0)              # [M, D] step time it adds
        extra[full] = np.inf
        extra = extra.ravel()
        placed = False
        for c in np.argsort(extra, kind="stable"):
            m, k = divmod(int(c), len(degrees))
            if not np.isfinite(extra[c]) or extra[c] >= times.min():        # a micro-batch of its own is cheaper
                break
            trial = counts[m].copy()
            trial[k] += 1
            if places(dict(zip(degrees.tolist(), trial.tolist())), n, per_node):
                kept[m].append(GroupAssignment(int(degrees[k]), x.seq_ids))
                counts[m], span[m], placed = trial, max(span[m], float(times[k])), True
                break
            full[m, k] = True
        if not placed:                                                   # alone: any tile of its best degree
            k = int(np.argmin(times))
            kept.append([GroupAssignment(int(degrees[k]), x.seq_ids)])
            counts = np.vstack([counts, np.eye(len(degrees), dtype=np.int64)[k]])
            span = np.append(span, float(times[k]))
            full = np.vstack([full, np.zeros(len(degrees), dtype=bool)])
    return Schedule(tuple(tuple(mb) for mb in kept if mb)), len(moved)


def solver_costs(cost: CostModel, cluster: Cluster, degrees) -> tuple[DegreeCosts, DegreeCosts | None]:
    """The solver's per-degree costs for ``degrees`` and, when they do not nest, the costs of their
    nesting subset (the fallback; None when they nest, or when no degree of theirs nests, as in
    ``(3,)`` or ``(3, 6)`` on nodes of 8: then the set is planned as given and repaired). Non-nesting
    costs carry the placement check and the tile counts; nesting ones carry neither, so power-of-two
    planning is unchanged."""
    costs = cost.degree_costs(degrees)
    if cluster.nests(costs.degrees):
        return costs, None
    placement = Placement(costs.degrees, cluster.num_gpus, cluster.gpus_per_node)
    costs = dataclasses.replace(costs, tiles=placement.tiles(), placeable=placement)
    subset = nesting_subset(costs.degrees, cluster.num_gpus, cluster.gpus_per_node)
    return costs, cost.degree_costs(subset) if subset else None


class TimeLimitWarning(UserWarning):
    """A strategy was still planning when ``time_limit`` passed: the wall-clock safety net cut its
    search, so the plan may differ on a faster or less loaded machine (searches are otherwise
    bounded in work and deterministic). Raise ``time_limit`` for a reproducible plan."""


def largest_held(cost: CostModel, cluster: Cluster, config: PlanConfig | None = None) -> tuple[int, int]:
    """``(tokens, degree)``: the longest sequence a plan with ``config`` can hold on ``cluster`` (the
    capacity of its largest usable degree), what a batch is checked against before any planning."""
    config = (config if config is not None else PlanConfig()).checked(cost, cluster)
    degree = cluster.usable_degrees(config.max_degree, config.degrees)[-1]
    return cost.group_capacity(degree), degree


def check_held(lengths: np.ndarray, cost: CostModel, cluster: Cluster, degree: int,
               where: Callable[[int], str] | None = None) -> None:
    """A ``PlanError`` when the longest of ``lengths`` is more than a group of ``degree`` GPUs (the largest
    usable) holds, naming it by ``where(i)`` (e.g. a file's line; default ``"sequence i has L tokens"``),
    its length and the cluster's capacity. Integers: exact at any size."""
    longest = int(np.argmax(lengths))
    length, held = int(lengths[longest]), cost.group_capacity(degree)
    if length > held:
        name = where(longest) if where is not None else f"sequence {longest} has {length} tokens"
        top = cluster.all_degrees[-1]
        raise PlanError(f"{name}, more than the whole cluster can hold: {degree} GPUs x {cost.token_capacity:.0f} "
                        f"tokens = {held}" + ("" if degree == top else f" (largest allowed degree; the cluster's "
                                                                      f"largest is {top})"))


class _FromConfig:
    """``plan_batch``'s strategy default: the config's strategy (None is a bad name, not "unset")."""

    def __repr__(self) -> str:
        return "<the config's strategy>"


_FROM_CONFIG: Any = _FromConfig()


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
    with cyclic_gc_paused():
        return _plan_batch(lengths, cost, cluster, strategy, config, settings)


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while planning. A 16,384-GPU plan allocates millions of
    small objects (one group per sequence, tuples, arrays) that hold no reference cycles, and the
    collections their allocation triggers cost a quarter of the solve while freeing nothing (Wikipedia
    at 16,384 GPUs: 1.69 s -> 1.22 s; plans identical). Reference counting still frees everything; the
    collector is resumed on exit if it was running (a caller that paused it keeps it paused)."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _plan_batch(lengths: Iterable[int] | np.ndarray, cost: CostModel, cluster: Cluster, strategy: str,
                config: PlanConfig | None, settings: dict[str, Any]) -> Plan:
    """``plan_batch``'s body (its warnings point at ``plan_batch``'s caller: stacklevel 3)."""
    from solver import kernels          # numba loads with the first plan, not with ``import flexsp``
    kernels.warm()                      # the packer compiled or loaded before the time limit's clock starts
    started = time.perf_counter()
    lengths = as_lengths(lengths)
    config = config if config is not None else PlanConfig()
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config must be a flexsp.PlanConfig, got {type(config).__name__}")
    if strategy is not _FROM_CONFIG:
        settings["strategy"] = strategy
    config = (config.replace(**settings) if settings else config).checked(cost, cluster)
    costs, fallback = solver_costs(cost, cluster, cluster.usable_degrees(config.max_degree, config.degrees))   # CostModelError names a degree without bandwidth
    nesting = costs.placeable is None
    check_held(lengths, cost, cluster, costs.degrees[-1])
    options = SearchOptions(num_buckets=config.num_buckets)
    strategy = config.strategy
    meta: dict[str, Any] = {}

    cut_short = False                       # a search stopped at its deadline (its own share of the limit too)

    def run(with_costs: DegreeCosts, name: str = strategy) -> Schedule:
        nonlocal cut_short
        schedule = registry.run_strategy(name, registry.PlanRequest(
            lengths, with_costs, cluster.num_gpus, options, started + config.time_limit, config.sp_degree,
            fallback=fallback if with_costs is costs else None))
        cut_short |= schedule.cut_short
        return schedule
    try:
        schedule = run(costs)
    except (InfeasibleDegree, Infeasible) as exc:
        if fallback is None or (config.sp_degree is not None and config.sp_degree not in fallback.degrees):
            raise PlanError(f"{strategy}: {exc}") from None
        try:
            schedule, costs, meta["fallback"] = run(fallback), fallback, list(fallback.degrees)
        except (InfeasibleDegree, Infeasible):
            raise PlanError(f"{strategy}: {exc}") from None
    if not nesting and "fallback" not in meta:
        schedule, moved = repair(schedule, cluster, lengths, costs)
        if moved:
            meta["repaired_groups"] = moved
        # a candidate whose plan does not place was passed over by the search (it keeps what gets ranks), though
        # repaired it can win (the candidates are cheap: tried always); a repaired plan may also be slower than the
        # nesting subset's (a second search: tried only then)
        tries = [(c, costs) for c in registry.get_strategy(strategy).candidates]
        if moved and fallback is not None and (config.sp_degree is None or config.sp_degree in fallback.degrees):
            tries.append((strategy, fallback))
        for name, with_costs in tries:
            try:
                other = run(with_costs, name)
            except (InfeasibleDegree, Infeasible):
                continue
            if with_costs is costs:
                other = repair(other, cluster, lengths, costs)[0]
            if other.time(lengths, with_costs) < schedule.time(lengths, costs):
                schedule, costs = other, with_costs
                meta.pop("candidate", None)           # only the plan that won is named
                meta.pop("fallback", None)
                meta.update({"fallback": list(fallback.degrees)} if with_costs is fallback else {"candidate": name})
    searched = time.perf_counter() - started
    hit = searched > config.time_limit or cut_short
    if hit:
        when = (f"the time limit of {config.time_limit:g} s passed while planning ({searched:.2f} s)"
                if searched > config.time_limit else
                f"the search for splits reached its share of the time limit of {config.time_limit:g} s (the rest "
                f"refines its plan; {searched:.2f} s in all)")
        warnings.warn(TimeLimitWarning(
            f"{strategy}: {when}; the search was cut short and the plan may depend on machine load (raise "
            f"time_limit to reproduce it)"), stacklevel=3)
    micro_batches = place(schedule, cost, cluster)
    if hit:
        meta["time_limit_hit"] = True
    plan = Plan(num_gpus=cluster.num_gpus, micro_batches=micro_batches,
                predicted_time=schedule.time(lengths, costs), strategy=strategy,
                gpus_per_node=cluster.gpus_per_node, solve_time=time.perf_counter() - started,
                meta=meta)
    if config.validate:
        plan.validate(lengths, cost, cluster)
    return plan


__all__ = ["plan_batch", "cyclic_gc_paused", "place", "repair", "solver_costs", "largest_held", "check_held", "TimeLimitWarning"]
