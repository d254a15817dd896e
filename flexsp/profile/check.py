"""Validation: run the groups of a plan for real and compare measured to predicted group times.

A group of degree ``d`` runs on the first aligned block ``[0, d)`` of this world (any aligned block
of that degree is equivalent hardware-wise inside a node), one group at a time; groups wider than
the world, and Ulysses x ring groups (the runner runs pure Ulysses), are skipped and listed. So one process checks every degree-1 group, ``torchrun`` with N
processes every group up to N. Predicted is ``cost.group_time(lengths, d)``; error is relative.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from flexsp.plan.cost import CostModel
from flexsp.plan.types import Plan
from flexsp.profile.compute import GroupRunner
from flexsp.runtime.pool import GroupPool


@dataclass(frozen=True)
class GroupCheck:
    micro_batch: int
    group: int
    degree: int
    tokens: int
    sequences: int
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class CheckReport:
    groups: tuple[GroupCheck, ...]
    skipped: tuple[tuple[int, int, int], ...]    # (micro-batch, group, degree) wider than the world or with a ring

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean([abs(g.rel_error) for g in self.groups])) if self.groups else float("nan")

    @property
    def max_abs_error(self) -> float:
        return float(np.max([abs(g.rel_error) for g in self.groups])) if self.groups else float("nan")

    def to_dict(self) -> dict:
        return {"mean_abs_rel_error": self.mean_abs_error, "max_abs_rel_error": self.max_abs_error,
                "groups": [dict(g.__dict__, rel_error=g.rel_error) for g in self.groups],
                "skipped": [list(s) for s in self.skipped]}


def check_plan(plan: Plan, lengths: Sequence[int], cost: CostModel, runner: GroupRunner, pool: GroupPool, *,
               repeats: int = 3, warmup: int = 1, statistic: str = "median", progress=None) -> CheckReport:
    """Every rank calls this with the same plan and lengths; every rank gets the same report."""
    lengths = [int(n) for n in lengths]
    # memory too (a group over this cost model's capacity was planned for another model or GPU: running it would
    # allocate past the device), as the replay checks; the recorded predicted time is not compared
    plan.validate(lengths=lengths, cost=cost, rel_tol=math.inf)
    checks, skipped = [], []
    for m, mb in enumerate(plan.micro_batches):
        for j, g in enumerate(mb.groups):
            d = g.degree
            if d > pool.world_size or d not in pool.degrees or g.ring > 1:   # the runner runs Ulysses only
                skipped.append((m, j, d))
                continue
            seqs = [lengths[s] for s in g.seq_ids]
            seconds = 0.0
            if pool.rank < d:
                block = tuple(range(d))
                times = runner.time_group(seqs, group=pool.get(block), local_rank=pool.rank, repeats=repeats,
                                          warmup=warmup, seed=m * 1000 + j)
                seconds = float(np.min(times) if statistic == "min" else np.median(times))
            if pool.world_size > 1:   # share rank 0's figure so every rank returns the same report
                t = torch.tensor([seconds], dtype=torch.float64, device=runner.setup.device)
                dist.broadcast(t, src=0)
                seconds = float(t.item())
            check = GroupCheck(m, j, d, sum(seqs), len(seqs), seconds, cost.group_time(seqs, d))
            checks.append(check)
            if progress is not None:
                progress(f"check: micro-batch {m} group {j} degree {d} {sum(seqs):>7} tokens "
                         f"measured {seconds * 1e3:9.2f} ms predicted {check.predicted * 1e3:9.2f} ms "
                         f"({check.rel_error:+.1%})")
    return CheckReport(tuple(checks), tuple(skipped))
