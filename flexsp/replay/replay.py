"""Replay a plan on one device: measured compute per group, modelled communication, both makespans.

A Ulysses x ring group (``Group.ring > 1``) is replayed as its Ulysses group of ``degree / ring``
ranks, measured, with the work split evenly over the ring; its communication is the all-to-all at the
Ulysses bandwidth plus the ring's K/V passing that attention does not hide (``exposed_ring_time``:
the cost model's ring bandwidth and per-hop latency), modelled, not measured.

``Replayer(model, setup).replay(plan, lengths, cost)`` checks the plan against the batch, the model
and the cost model before running anything, then for every group of every micro-batch runs the
representative rank(s) of that group (``runner.representative_ranks``) and reports a
``ReplayReport``. Identical groups (same degree and lengths) are measured once per ``Replayer``.
"""
from __future__ import annotations

import math
import platform
import warnings
from typing import Callable, Sequence

import numpy as np
import torch

from flexsp.errors import CostModelError, PlanError
from flexsp.plan.cost import CostModel
from flexsp.plan.types import Plan
from flexsp.profile.compute import DeviceSetup
from flexsp.profile.shape import ShapeWarning, check_model_shape
from flexsp.replay.comm_time import comm_time, exposed_ring_time
from flexsp.replay.report import GroupReplay, ReplayReport
from flexsp.replay.runner import RankRunner, ReplayModel, representative_ranks
from flexsp.runtime.sp.context import ShardingError, check_heads

STATISTICS = {"median": np.median, "min": np.min, "mean": np.mean}


def check_replayable(plan: Plan, lengths: Sequence[int], cost: CostModel, model: ReplayModel) -> list[str]:
    """Raise a ``FlexSPError`` naming the problem if ``plan`` cannot be replayed for ``model`` under
    ``cost``; return notes (warnings) for the report. Nothing runs on the device."""
    lengths = [int(n) for n in lengths]
    if any(n < 1 for n in lengths):
        raise PlanError(f"sequence lengths must be >= 1, got {[n for n in lengths if n < 1][:8]}")
    ids = [s for mb in plan.micro_batches for g in mb.groups for s in g.seq_ids]
    unknown = sorted({s for s in ids if not 0 <= s < len(lengths)})
    if unknown:
        raise PlanError(f"plan references sequence ids {unknown[:8]} but the lengths hold {len(lengths)} sequences: "
                        f"was it planned for another batch?")
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShapeWarning)
        if model.shape is not None:
            check_model_shape(cost, model.shape, strict=True)   # CostModelError: profiled for another model
    notes += [str(w.message) for w in caught]
    plan.validate(lengths=lengths)
    for m, mb in enumerate(plan.micro_batches):
        for j, g in enumerate(mb.groups):
            where = f"micro-batch {m} group {j}"
            try:
                check_heads(model.heads, model.kv_heads, g.ulysses)     # a ring group runs Ulysses over g.ulysses
            except ShardingError as exc:
                raise PlanError(f"{where}: {exc}; this plan is for a model with more heads") from None
            try:
                cost.bandwidth(g.ulysses)
                cost.coefficients(g.degree)                # a ring group needs the ring's bandwidth
            except CostModelError as exc:
                raise CostModelError(f"{where}: {exc} (or pass a measured table: --bandwidth FILE)") from None
    # Memory is checked (a group over capacity was planned for another model or GPU); the recorded
    # predicted time is not, since the replay reports this cost model's prediction anyway.
    plan.validate(lengths=lengths, cost=cost, rel_tol=math.inf)
    actual = plan.time(lengths, cost)
    if not math.isclose(actual, plan.predicted_time, rel_tol=1e-6, abs_tol=1e-9):
        notes.append(f"the plan records a predicted time of {plan.predicted_time:.6g} s but this cost model gives "
                     f"{actual:.6g} s: it was planned with another cost model; predictions here are this one's")
    return notes


class Replayer:
    """Replays plans for one model on one device; keep one to reuse measurements across plans."""

    def __init__(self, model: ReplayModel, setup: DeviceSetup, *, repeats: int = 3, warmup: int = 1,
                 statistic: str = "median", clock: str = "wall", tolerance: float = 0.05, seed: int = 0) -> None:
        if statistic not in STATISTICS:
            raise PlanError(f"unknown statistic {statistic!r}; choose one of {sorted(STATISTICS)}")
        self.model, self.setup, self.statistic, self.clock = model, setup, statistic, clock
        self.repeats, self.warmup, self.tolerance = repeats, warmup, tolerance
        self.runner = RankRunner(model, setup, repeats=repeats, warmup=warmup, clock=clock, seed=seed)
        self._cache: dict[tuple, tuple[tuple[int, ...], tuple[float, ...], int | None]] = {}

    def measure_group(self, lengths: Sequence[int], degree: int) -> tuple[tuple[int, ...], tuple[float, ...], int | None]:
        """(replayed local ranks, timed samples of the slowest one, peak memory) for one group."""
        key = (degree, tuple(int(n) for n in lengths))
        if key not in self._cache:
            ranks = representative_ranks(lengths, degree, self.tolerance)
            timings = [self.runner.time_rank(lengths, degree, r, seed=len(self._cache)) for r in ranks]
            stat = STATISTICS[self.statistic]
            slowest = max(timings, key=lambda t: stat(t.samples))
            peaks = [t.peak_memory_bytes for t in timings if t.peak_memory_bytes is not None]
            self._cache[key] = (ranks, slowest.samples, max(peaks) if peaks else None)
        return self._cache[key]

    def replay(self, plan: Plan, lengths: Sequence[int], cost: CostModel, *,
               progress: Callable[[str], None] | None = None) -> ReplayReport:
        lengths = [int(n) for n in lengths]
        notes = check_replayable(plan, lengths, cost, self.model)
        stat = STATISTICS[self.statistic]
        groups = []
        for m, mb in enumerate(plan.micro_batches):
            for j, g in enumerate(mb.groups):
                seqs = [lengths[s] for s in g.seq_ids]
                # a Ulysses x ring group: the Ulysses group of g.ulysses ranks is measured and its work
                # split evenly over the ring (zigzag chunks balance causal attention); the ring's K/V
                # passing is modelled, only what attention does not hide is added
                ranks, samples, peak = self.measure_group(seqs, g.ulysses)
                samples = tuple(t / g.ring for t in samples)
                comm = comm_time(cost, sum(seqs), g.degree) + exposed_ring_time(cost, seqs, g.degree)
                replay = GroupReplay(m, j, g.degree, g.ranks[0], len(seqs), sum(seqs), ranks, samples,
                                     float(stat(samples)), comm, cost.group_time(seqs, g.degree), peak)
                groups.append(replay)
                if progress is not None:
                    progress(f"replay: micro-batch {m} group {j} degree {g.degree} {sum(seqs):>7} tokens: compute "
                             f"{replay.compute * 1e3:9.2f} ms + comm {replay.comm * 1e3:8.2f} ms vs predicted "
                             f"{replay.predicted * 1e3:9.2f} ms")
        return ReplayReport(tuple(groups), len(plan.micro_batches), plan.num_gpus, plan.strategy,
                            self.describe(cost, notes))

    def describe(self, cost: CostModel, notes: Sequence[str] = ()) -> dict:
        """Provenance: what was measured, on what, and where the communication figures come from."""
        setup, model = self.setup, self.model
        device = setup.name
        comm_source = cost.meta.get("replay_bandwidth_source") or (
            f"cost model ({cost.meta.get('preset') or cost.meta.get('source') or 'custom'}) bandwidths")
        threads = torch.get_num_threads() if setup.device.type == "cpu" else None
        return {
            "label": (f"measured compute on {device} ({'GPU' if setup.device.type == 'cuda' else 'CPU'}, "
                      f"{str(setup.dtype).replace('torch.', '')}, {self.clock} clock); communication modelled from "
                      f"{comm_source}"),
            "device": device, "device_type": setup.device.type, "dtype": str(setup.dtype).replace("torch.", ""),
            "attention": setup.backend, "torch": torch.__version__, "python": platform.python_version(),
            "threads": threads, "clock": self.clock, "repeats": self.repeats, "warmup": self.warmup,
            "statistic": self.statistic, "model": None if model.shape is None else dict(model.shape.__dict__),
            "run_layers": model.run_layers, "comm_source": comm_source,
            "cost_model": cost.meta.get("preset") or cost.meta.get("source") or "custom",
            "peak_memory": "device peak of the replayed parts (run_layers blocks), CUDA only",
            "notes": list(notes),
        }


def replay_plan(plan: Plan, lengths: Sequence[int], cost: CostModel, model: ReplayModel,
                setup: DeviceSetup | None = None, **options) -> ReplayReport:
    """One-shot ``Replayer(model, setup, **options).replay(plan, lengths, cost)``; ``setup`` defaults to
    the device the model's parameters are on."""
    if setup is None:
        first = next(model.parts[0][0].parameters())
        setup = DeviceSetup(first.device, first.dtype)
    progress = options.pop("progress", None)
    return Replayer(model, setup, **options).replay(plan, lengths, cost, progress=progress)
