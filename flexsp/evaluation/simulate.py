"""Offline simulation: plan many sampled global batches with several strategies and compare.

A strategy is named as ``plan_batch`` and ``PlanConfig`` name it (``flexsp.plan.strategies.parse_strategy``,
one syntax for ``simulate --strategies``, ``plan --strategy`` and ``PlanConfig(strategy=...)``); ``static:D`` pins the static degree (the paper's
DeepSpeed baseline is the better of ``static:64`` and ``static:32``), and a suffix ``[1,8,64]``
restricts a strategy to those SP degrees, e.g. ``flexsp[1,8,64]``, to see what bounding the
communicators per rank costs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from flexsp.errors import FlexSPError, PlanError
from flexsp.inputs import limit, too_large
from flexsp.plan.bounds import coupled_lower_bound, lower_bound
from flexsp.plan.cluster import Cluster
from flexsp.plan.communicator_memory import describe_reservation, pool_degrees, reserve_communicators
from flexsp.plan.config import PlanConfig
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import LengthDistribution, padded_and_kept, preprocess
from flexsp.plan.planner import largest_held, plan_batch
from flexsp.plan.strategies import StrategySpec, get_strategy, parse_strategy, parse_strategy_list, strategies  # noqa: F401 (re-exported)
from flexsp.plan.types import Plan


@dataclass
class StrategyRun:
    name: str
    step_times: list[float] = field(default_factory=list)
    solve_times: list[float] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    degrees: Counter = field(default_factory=Counter)
    first_plan: Plan | None = None
    error: str | None = None
    cost: CostModel | None = None        # the model it planned with (capacity less its communicators' memory)
    plans: list = field(default_factory=list)   # (plan, lengths) per step, when simulate(keep_plans=True)

    @property
    def total(self) -> float:
        return float(sum(self.step_times)) if not self.error else float("nan")


@dataclass
class Simulation:
    dataset: str
    approximate: bool
    num_gpus: int
    context: int
    batch_size: int
    steps: int
    dropped_share: float                 # share of the distribution above the context limit
    runs: dict[str, StrategyRun]
    lower_bounds: list[float]
    first_batch: np.ndarray
    coupled_bounds: list[float] = field(default_factory=list)   # flexsp.plan.bounds.coupled_lower_bound per step
    communicator_bytes: float | None = None   # per communicator, subtracted from capacity (None: not)

    def speedup(self, strategy: str, over: str) -> float:
        return self.runs[over].total / self.runs[strategy].total

    def to_dict(self) -> dict:
        return {
            "dataset": self.dataset, "approximate": self.approximate, "num_gpus": self.num_gpus,
            "context": self.context, "batch_size": self.batch_size, "steps": self.steps,
            "dropped_share": self.dropped_share, "lower_bounds": self.lower_bounds,
            "coupled_lower_bounds": self.coupled_bounds,
            "strategies": {name: {"total_time": run.total, "step_times": run.step_times, "solve_times": run.solve_times,
                                  "micro_batches": run.micro_batches, "degree_histogram": dict(sorted(run.degrees.items())),
                                  "error": run.error, "token_capacity": run.cost.token_capacity if run.cost else None}
                           for name, run in self.runs.items()},
        }


def default_strategies(cluster: Cluster, include_dynamic_cp: bool = True) -> list[str]:
    """The registered strategies marked for the default comparison; one that takes an SP degree is
    listed at N and N/2 (after the others)."""
    top = cluster.degrees[-1]
    chosen = [s for s in strategies() if s.in_default_comparison and (include_dynamic_cp or s.name != "dynamic-cp")]
    pinned = [f"{s.name}:{d}" for s in chosen if s.accepts_sp_degree for d in ([top] + ([top // 2] if top >= 2 else []))]
    return [s.name for s in chosen if not s.accepts_sp_degree] + pinned


@dataclass(frozen=True)
class Outcome:
    """One strategy on one batch: what ``simulate`` records, small enough to send between processes."""

    predicted_time: float = float("nan")
    solve_time: float = float("nan")
    micro_batches: int = 0
    degrees: tuple[tuple[int, int], ...] = ()
    plan: Plan | None = None       # kept only where asked (the first step's, for the Gantt chart)
    error: str | None = None       # a PlanError a restricted strategy may have (static, [degrees])
    fatal: BaseException | None = None   # a PlanError any other strategy must not have: re-raised


def plan_step(lengths: np.ndarray, costs: tuple[CostModel, ...], cluster: Cluster, strategies: tuple[str, ...],
              config: PlanConfig, keep_plan: bool = False) -> tuple[Outcome, ...]:
    """Every strategy on one batch, each with its own cost model and ``config`` with the strategy's name,
    degree and degrees (module-level, so worker processes can run it)."""
    out = []
    for name, cost in zip(strategies, costs):
        spec = parse_strategy(name)
        try:
            plan = plan_batch(lengths, cost, cluster, config=config.replace(
                strategy=spec.strategy, sp_degree=spec.sp_degree,
                degrees=spec.degrees if spec.degrees is not None else config.degrees))
        except PlanError as exc:
            restricted = (spec.sp_degree is not None or spec.strategy == "static" or spec.degrees is not None
                          or config.degrees is not None)
            out.append(Outcome(error=str(exc)) if restricted else Outcome(fatal=exc))
            continue
        out.append(Outcome(plan.predicted_time, plan.solve_time, len(plan.micro_batches),
                           tuple(plan.degree_histogram().items()), plan if keep_plan else None))
    return tuple(out)


def plan_steps(batches: Sequence[np.ndarray], cost: CostModel, cluster: Cluster, strategies: Sequence[str], *,
               config: PlanConfig = PlanConfig(), workers: int = 1, keep_plans: int = 1,
               strategy_costs: Sequence[CostModel] | None = None) -> Iterator[tuple[Outcome, ...]]:
    """``plan_step`` on every batch, in order; ``workers > 1`` plans batches side by side in that many
    spawned processes. Plans are the same as serial ones (the solver is deterministic) unless
    ``config.time_limit`` binds, which it does sooner when workers share fewer cores than they are; solve
    times are measurements either way. The first ``keep_plans`` batches keep their plans.
    ``strategy_costs`` gives each strategy its own cost model (default: ``cost`` for all)."""
    if workers < 1:
        raise FlexSPError(f"workers must be >= 1, got {workers}")
    names = tuple(strategies)
    costs = tuple(strategy_costs) if strategy_costs is not None else (cost,) * len(names)
    if len(costs) != len(names):
        raise FlexSPError(f"strategy_costs has {len(costs)} cost models for {len(names)} strategies")
    if workers == 1 or len(batches) <= 1:
        for i, lengths in enumerate(batches):
            yield plan_step(lengths, costs, cluster, names, config, i < keep_plans)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max_workers=min(workers, len(batches)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        n = len(batches)
        yield from pool.map(plan_step, batches, [costs] * n, [cluster] * n, [names] * n, [config] * n,
                            [i < keep_plans for i in range(n)])


def simulate(distribution: LengthDistribution, cost: CostModel, cluster: Cluster, strategies: list[str], *,
             steps: int = 10, batch_size: int = 512, context: int = 384 * 1024, seed: int = 0,
             config: PlanConfig = PlanConfig(), progress: bool = True, workers: int = 1,
             communicator_bytes: float | None = None, keep_plans: bool = False) -> Simulation:
    """Plan ``steps`` batches of ``batch_size`` lengths drawn (seeded) from ``distribution``, with
    the paper's preprocessing: sequences above ``context`` are not drawn, lengths are padded to a
    multiple of 2 x N. ``config`` holds the planning settings (time limit, ...); each strategy of
    ``strategies`` sets its own name, degree and degrees in it. A strategy that cannot plan a batch (e.g. a static degree too small for its
    longest sequence) is reported with its error instead of a time. ``workers`` plans that many
    steps at once in separate processes, with the same results as one (see ``plan_steps``). With
    ``communicator_bytes``, each strategy plans with the capacity left after its pool's communicators
    (``flexsp.plan.communicator_memory``). ``keep_plans`` keeps every step's ``(plan, lengths)`` in ``run.plans``
    (for ``--replay``)."""
    if steps < 1 or batch_size < 1:
        raise FlexSPError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if steps * batch_size > limit("sequences"):   # every step's draw is held at once (bounds, workers)
        raise FlexSPError(too_large(f"the simulation ({steps:,} steps x {batch_size:,})", steps * batch_size, "sequences"))
    pool = distribution.lengths[distribution.lengths <= context]
    if pool.size == 0:
        raise FlexSPError(f"no sequence of {distribution.name} fits the context limit {context}")
    dropped_share = 1.0 - pool.size / distribution.lengths.size
    runs = {name: StrategyRun(name, cost=_strategy_cost(cost, cluster, name, communicator_bytes, config.degrees))
            for name in strategies}
    rng = np.random.default_rng(seed)
    index = np.flatnonzero(distribution.lengths <= context)          # pool position -> distribution position
    draws = [index[rng.integers(0, pool.size, size=batch_size)] for _ in range(steps)]
    _check_held(distribution, draws, cost, runs, cluster, config, context)
    batches = [preprocess(distribution.lengths[drawn], context, cluster.num_gpus)[0] for drawn in draws]
    bounds = [lower_bound(lengths, cost, cluster, degrees=config.degrees) for lengths in batches]
    coupled = [coupled_lower_bound(lengths, cost, cluster, degrees=config.degrees) for lengths in batches]
    active = [name for name in strategies if not runs[name].error]      # not those that cannot hold a draw
    bar = tqdm(total=steps * len(active), desc=f"simulate {distribution.name}", disable=not progress, leave=False)
    planned = plan_steps(batches, cost, cluster, active, config=config, workers=workers,
                         keep_plans=steps if keep_plans else 1, strategy_costs=[runs[name].cost for name in active])
    for lengths, outcomes in zip(batches, planned):
        for name, outcome in zip(active, outcomes):
            run = runs[name]
            bar.update(1)
            if run.error:
                continue   # a strategy that failed once is out for the whole run
            if outcome.fatal is not None:
                raise outcome.fatal
            if outcome.error is not None:
                run.error = outcome.error
                continue
            run.step_times.append(outcome.predicted_time)
            run.solve_times.append(outcome.solve_time)
            run.micro_batches.append(outcome.micro_batches)
            run.degrees.update(dict(outcome.degrees))
            run.first_plan = run.first_plan or outcome.plan
            if keep_plans:
                run.plans.append((outcome.plan, lengths))
    bar.close()
    return Simulation(distribution.name, distribution.approximate, cluster.num_gpus, context, batch_size, steps,
                      dropped_share, runs, bounds, batches[0], coupled, communicator_bytes)


def _restricted(name: str) -> bool:
    """A strategy limited to a degree or a degree set (``static:8``, ``flexsp[1,8]``): it may find a batch
    infeasible (reported in its row) where the cluster could hold it."""
    spec = parse_strategy(name)
    return spec.sp_degree is not None or spec.degrees is not None or get_strategy(spec.strategy).accepts_sp_degree


def _held_by(name: str, cost: CostModel, cluster: Cluster, config: PlanConfig) -> tuple[int, int]:
    """``(tokens, degree)``: the longest sequence strategy ``name`` can plan (``static:8``: a group of 8)."""
    spec = parse_strategy(name)
    if spec.sp_degree is not None:
        return cost.group_capacity(spec.sp_degree), spec.sp_degree
    return largest_held(cost, cluster, config.replace(
        strategy=spec.strategy, degrees=spec.degrees if spec.degrees is not None else config.degrees))


def _too_long(distribution: LengthDistribution, draws: Sequence[np.ndarray], held: int, degree: int,
              cost: CostModel, cluster: Cluster, context: int, holder: str) -> str | None:
    """The first drawn sequence that, padded, is longer than ``held`` tokens, in the terms of its source (a
    file's line and value), or None: checked before any bound or plan."""
    for step, drawn in enumerate(draws):
        padded, kept = padded_and_kept(distribution.lengths[drawn], context, cluster.num_gpus)   # as preprocess
        over = np.flatnonzero((padded > held) & kept)
        if over.size:
            i = int(drawn[over[0]])
            length, pad = int(distribution.lengths[i]), int(padded[over[0]])
            return (f"{distribution.where(i)}: a sequence of {length:,} tokens"
                    + (f" ({pad:,} once padded to a multiple of 2 x {cluster.num_gpus} GPUs)" if pad != length else "")
                    + f", drawn for step {step}, is more than {holder} holds: {degree} GPUs x "
                    f"{cost.token_capacity:,.0f} tokens = {held:,}")
    return None


def _check_held(distribution: LengthDistribution, draws: Sequence[np.ndarray], cost: CostModel,
                runs: dict[str, StrategyRun], cluster: Cluster, config: PlanConfig, context: int) -> None:
    """Before any bound or plan: a ``PlanError`` when a drawn sequence is longer than the cluster holds with
    ``config``'s degrees (the least capacity of ``cost`` and the unrestricted strategies' models), saying
    what would make the run work; a restricted strategy (``static:8``, ``flexsp[1,2]``) that cannot hold
    one is marked infeasible with the same words and not planned."""
    costs = [cost] + [run.cost for name, run in runs.items() if not _restricted(name)]
    held, degree, smallest = min(((*largest_held(c, cluster, config), c) for c in costs), key=lambda t: t[0])
    problem = _too_long(distribution, draws, held, degree, smallest, cluster, context, "the cluster")
    if problem is not None:
        top = cluster.all_degrees[-1]
        safe = held - held % (2 * cluster.num_gpus)
        raise PlanError(problem + ("" if degree == top else f" at the largest SP degree allowed (the cluster's "
                                                            f"largest is {top}: --degrees)")
                        + f"; use more GPUs, or a context limit of at most {safe:,} (--context {safe}) to leave "
                        f"such sequences out of the draws")
    for name, run in runs.items():
        if _restricted(name):
            try:
                held, degree = _held_by(name, run.cost, cluster, config)
            except PlanError as exc:         # e.g. a degree without a tile: its row says so, the others run
                run.error = str(exc)
                continue
            run.error = _too_long(distribution, draws, held, degree, run.cost, cluster, context, name)


def _strategy_cost(cost: CostModel, cluster: Cluster, name: str, communicator_bytes: float | None,
                   degrees: tuple[int, ...] | str | None = None) -> CostModel:
    if communicator_bytes is None:
        return cost
    spec = parse_strategy(name)
    chosen = spec.degrees if spec.degrees is not None else degrees
    return reserve_communicators(cost, pool_degrees(cluster, spec.strategy, chosen, spec.sp_degree, cost),
                                 communicator_bytes, gpus_per_node=cluster.gpus_per_node)


def format_communicator_memory(sim: Simulation) -> str:
    """Per strategy: communicators its pool holds, their memory, and the token capacity it planned with."""
    if sim.communicator_bytes is None:
        return "communicator memory: not subtracted from capacity (--communicator-memory to subtract it)"
    return "\n".join(["communicator memory (subtracted from capacity before planning):"]
                     + [describe_reservation(run.cost, f"  {name}: ") for name, run in sim.runs.items()])


def format_table(sim: Simulation, reference: str = "flexsp", replayed: dict | None = None) -> str:
    """Markdown table: one row per strategy. The speedup column appears only when ``reference`` ran
    (a run of one other strategy has nothing to compare with). ``replayed`` (strategy -> seconds, from
    ``flexsp.replay.cli.replay_simulation``) adds the measured-compute total and speedup."""
    lb_total, coupled_total = sum(sim.lower_bounds), sum(sim.coupled_bounds) or float("nan")
    compare = reference in sim.runs and not sim.runs[reference].error
    columns = ["strategy", "total time (s)", "mean step (s)", "/ lower bound", "/ coupled bound",
               *([f"{reference} speedup"] if compare else []), "mean micro-batches", "SP degrees used (groups)",
               "communicators per rank (degrees > 1 used)", "solve mean / max (s)"]
    if replayed:
        columns += ["replayed total (s)", *([f"{reference} speedup (replayed)"] if compare else [])]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, run in sim.runs.items():
        if run.error:
            lines.append(f"| {name} | infeasible: {run.error} |" + " |" * (len(columns) - 2))
            continue
        hist = " ".join(f"{d}x{c}" for d, c in sorted(run.degrees.items()))
        cells = [name, f"{run.total:.2f}", f"{run.total / len(run.step_times):.3f}", f"{run.total / lb_total:.3f}",
                 f"{run.total / coupled_total:.3f}", *([f"{sim.speedup(reference, name):.2f}x"] if compare else []),
                 f"{np.mean(run.micro_batches):.2f}", hist, str(communicators(run.degrees)),
                 f"{np.mean(run.solve_times):.3f} / {np.max(run.solve_times):.3f}"]
        if replayed:
            mine, ref = replayed.get(name), replayed.get(reference)
            cells.append("not replayed" if mine is None else f"{mine:.3f}")
            if compare:
                cells.append(f"{mine / ref:.2f}x" if mine is not None and ref else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def communicators(degrees_used) -> int:
    """Communicators each rank holds when the pool creates only the degrees a strategy used
    (every rank is in one aligned group per degree above 1)."""
    return sum(1 for d in degrees_used if d > 1)


def describe(sim: Simulation) -> str:
    label = " (APPROXIMATION of the real corpus)" if sim.approximate else ""
    return (f"{sim.dataset}{label}: {sim.steps} steps x {sim.batch_size} sequences, {sim.num_gpus} GPUs, "
            f"context {sim.context:,} ({sim.dropped_share:.2%} of the distribution is longer and not drawn)")
