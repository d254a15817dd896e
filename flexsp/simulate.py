"""Offline simulation: plan many sampled global batches with several strategies and compare.

A strategy is named as ``plan_batch`` names it; ``static:D`` pins the static degree (the paper's
DeepSpeed baseline is the better of ``static:64`` and ``static:32``), and a suffix ``[1,8,64]``
restricts a strategy to those SP degrees, e.g. ``flexsp[1,8,64]``, to see what bounding the
communicators per rank costs.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from .bounds import lower_bound
from .cluster import Cluster
from .cost import CostModel
from .errors import FlexSPError, PlanError
from .lengths import LengthDistribution, preprocess
from .plan import Plan
from .planner import plan_batch


@dataclass
class StrategyRun:
    name: str
    step_times: list[float] = field(default_factory=list)
    solve_times: list[float] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    degrees: Counter = field(default_factory=Counter)
    first_plan: Plan | None = None
    error: str | None = None
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

    def speedup(self, strategy: str, over: str) -> float:
        return self.runs[over].total / self.runs[strategy].total

    def to_dict(self) -> dict:
        return {
            "dataset": self.dataset, "approximate": self.approximate, "num_gpus": self.num_gpus,
            "context": self.context, "batch_size": self.batch_size, "steps": self.steps,
            "dropped_share": self.dropped_share, "lower_bounds": self.lower_bounds,
            "strategies": {name: {"total_time": run.total, "step_times": run.step_times, "solve_times": run.solve_times,
                                  "micro_batches": run.micro_batches, "degree_histogram": dict(sorted(run.degrees.items())),
                                  "error": run.error}
                           for name, run in self.runs.items()},
        }


@dataclass(frozen=True)
class StrategySpec:
    strategy: str
    sp_degree: int | None = None
    degrees: tuple[int, ...] | None = None


def parse_strategy_list(text: str) -> list[str]:
    """Comma-separated names, commas inside ``[...]`` kept: ``flexsp,flexsp[1,8,64]``."""
    return [m.strip() for m in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if m.strip()]


def parse_strategy(name: str) -> StrategySpec:
    """``flexsp`` / ``static:32`` / ``flexsp[1,8,64]`` -> what to pass to ``plan_batch``."""
    degrees = None
    if name.endswith("]") and "[" in name:
        name, inside = name[:-1].split("[", 1)
        try:
            degrees = tuple(int(d) for d in inside.split(",") if d.strip())
        except ValueError:
            raise PlanError(f"degrees in [{inside}] must be integers, e.g. flexsp[1,8,64]") from None
    if name.startswith("static:"):
        try:
            return StrategySpec("static", int(name.split(":", 1)[1]), degrees)
        except ValueError:
            raise PlanError(f"static degree in {name!r} must be an integer, e.g. static:32") from None
    return StrategySpec(name, None, degrees)


def default_strategies(cluster: Cluster, include_dynamic_cp: bool = True) -> list[str]:
    top = cluster.degrees[-1]
    statics = [f"static:{top}"] + ([f"static:{top // 2}"] if top >= 2 else [])
    return ["flexsp", "greedy", "batchada", *(["dynamic-cp"] if include_dynamic_cp else []), *statics]


def simulate(distribution: LengthDistribution, cost: CostModel, cluster: Cluster, strategies: list[str], *,
             steps: int = 10, batch_size: int = 512, context: int = 384 * 1024, seed: int = 0,
             time_limit: float = 2.0, progress: bool = True, keep_plans: bool = False) -> Simulation:
    """Plan ``steps`` batches of ``batch_size`` lengths drawn (seeded) from ``distribution``, with
    the paper's preprocessing: sequences above ``context`` are not drawn, lengths are padded to a
    multiple of 2 x N. A strategy that cannot plan a batch (e.g. a static degree too small for its
    longest sequence) is reported with its error instead of a time."""
    if steps < 1 or batch_size < 1:
        raise FlexSPError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    pool = distribution.lengths[distribution.lengths <= context]
    if pool.size == 0:
        raise FlexSPError(f"no sequence of {distribution.name} fits the context limit {context}")
    dropped_share = 1.0 - pool.size / distribution.lengths.size
    runs = {name: StrategyRun(name) for name in strategies}
    bounds, first_batch = [], None
    rng = np.random.default_rng(seed)
    bar = tqdm(total=steps * len(strategies), desc=f"simulate {distribution.name}", disable=not progress, leave=False)
    for _ in range(steps):
        lengths, _ = preprocess(pool[rng.integers(0, pool.size, size=batch_size)], context, cluster.num_gpus)
        first_batch = lengths if first_batch is None else first_batch
        bounds.append(lower_bound(lengths, cost, cluster))
        for name in strategies:
            run = runs[name]
            bar.update(1)
            if run.error:
                continue
            spec = parse_strategy(name)
            try:
                plan = plan_batch(lengths, cost, cluster, spec.strategy, sp_degree=spec.sp_degree,
                                  degrees=spec.degrees, time_limit=time_limit)
            except PlanError as exc:
                if spec.strategy != "static" and spec.degrees is None:
                    raise
                run.error = str(exc)
                continue
            run.step_times.append(plan.predicted_time)
            run.solve_times.append(plan.solve_time)
            run.micro_batches.append(len(plan.micro_batches))
            run.degrees.update(plan.degree_histogram())
            run.first_plan = run.first_plan or plan
            if keep_plans:
                run.plans.append((plan, lengths))
    bar.close()
    return Simulation(distribution.name, distribution.approximate, cluster.num_gpus, context, batch_size, steps,
                      dropped_share, runs, bounds, first_batch)


def format_table(sim: Simulation, reference: str = "flexsp", replayed: dict | None = None) -> str:
    """Markdown table: one row per strategy. ``replayed`` (strategy -> seconds, from
    ``flexsp.replay.cli.replay_simulation``) adds the measured-compute total and speedup."""
    lb_total = sum(sim.lower_bounds)
    head = ("| strategy | total time (s) | mean step (s) | / lower bound | "
            f"{reference} speedup | mean micro-batches | SP degrees used (groups) | communicators per rank | "
            "solve mean / max (s) |")
    if replayed:
        head += f" replayed total (s) | {reference} speedup (replayed) |"
    lines = [head, "|" + "---|" * (11 if replayed else 9)]
    for name, run in sim.runs.items():
        if run.error:
            lines.append(f"| {name} | infeasible: {run.error} | | | | | | | |" + (" | |" if replayed else ""))
            continue
        hist = " ".join(f"{d}x{c}" for d, c in sorted(run.degrees.items()))
        speed = sim.speedup(reference, name) if reference in sim.runs and not sim.runs[reference].error else float("nan")
        lines.append(f"| {name} | {run.total:.2f} | {run.total / len(run.step_times):.3f} | {run.total / lb_total:.3f} | "
                     f"{speed:.2f}x | {np.mean(run.micro_batches):.2f} | {hist} | {communicators(run.degrees)} | "
                     f"{np.mean(run.solve_times):.3f} / {np.max(run.solve_times):.3f} |")
        if replayed:
            mine, ref = replayed.get(name), replayed.get(reference)
            lines[-1] += (" not replayed | |" if mine is None else
                          f" {mine:.3f} | {mine / ref:.2f}x |" if ref else f" {mine:.3f} | |")
    return "\n".join(lines)


def communicators(degrees_used) -> int:
    """Communicators each rank holds when the pool creates only the degrees a strategy used
    (every rank is in one aligned group per degree above 1)."""
    return sum(1 for d in degrees_used if d > 1)


def describe(sim: Simulation) -> str:
    label = " (APPROXIMATION of the real corpus)" if sim.approximate else ""
    return (f"{sim.dataset}{label}: {sim.steps} steps x {sim.batch_size} sequences, {sim.num_gpus} GPUs, "
            f"context {sim.context:,} ({sim.dropped_share:.2%} of the distribution is longer and not drawn)")
