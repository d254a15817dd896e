"""How long a replay will keep the device busy, before it runs: for work under a device-time budget. No torch.

A replay runs the busiest rank of every group ``warmup + repeats`` times (identical groups once). With
``run_layers`` of the model's ``layers`` blocks it runs that many blocks plus, for the scaling, the
block-free model (embedding, head, loss) a second time, so only part of the full model's work runs:
attention ``run_layers / layers`` of it, token-linear work the share of the linear weights run
(``(k * per_layer + 2 * head) / (layers * per_layer + head)``). The cost model's compute prediction
scaled by those shares estimates the device seconds; ``BudgetClock`` corrects the estimate by the ratio
of measured to estimated time seen so far, and says whether the next piece of work still fits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from flexsp.plan.cost import CostModel
from flexsp.plan.specs import ModelSpec
from flexsp.plan.types import Plan


def work_shares(spec: ModelSpec, run_layers: int | None) -> tuple[float, float]:
    """(attention, token-linear) share of the full model's work one replay run does."""
    k = spec.layers if run_layers is None else min(int(run_layers), spec.layers)
    if k >= spec.layers or spec.layers == 0:
        return 1.0, 1.0
    head = spec.hidden * spec.vocab
    per_layer = (spec.linear_params - (0 if spec.tie_embeddings else head)) / spec.layers
    return k / spec.layers, (k * per_layer + 2 * head) / (spec.layers * per_layer + head)


def estimate_seconds(plan: Plan, lengths: Sequence[int], cost: CostModel, spec: ModelSpec, run_layers: int | None,
                     runs: int) -> float:
    """Device seconds to replay ``plan``: ``runs`` (warm-up + timed) runs of each distinct group's busiest
    rank, the cost model's compute at the shares this replay runs."""
    attention, linear = work_shares(spec, run_layers)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    total = 0.0
    for mb in plan.micro_batches:
        for g in mb.groups:
            seqs = tuple(int(lengths[s]) for s in g.seq_ids)
            if (g.degree, seqs) in seen:
                continue
            seen.add((g.degree, seqs))
            tokens = float(sum(seqs))
            # attention of full, windowed and chunked layers alike (CostModel.attention_seconds)
            total += (attention * float(np.sum(cost.attention_seconds(seqs))) + linear * cost.alpha2 * tokens) / g.degree \
                + linear * cost.beta1
    return runs * total


@dataclass
class BudgetClock:
    """Seconds left of ``budget`` since ``started``, and the measured / estimated ratio of work done so far."""

    budget: float
    started: float = field(default_factory=time.monotonic)
    clock: Callable[[], float] = time.monotonic
    estimated: float = 0.0
    measured: float = 0.0

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def ratio(self) -> float:
        """Measured over estimated seconds so far (1 before anything ran)."""
        return self.measured / self.estimated if self.estimated > 0 and self.measured > 0 else 1.0

    def expected(self, estimate: float) -> float:
        return estimate * self.ratio

    def fits(self, estimate: float) -> bool:
        """Whether work estimated at ``estimate`` seconds, corrected, ends within the budget."""
        return self.elapsed + self.expected(estimate) <= self.budget

    def record(self, estimate: float, seconds: float) -> None:
        self.estimated += estimate
        self.measured += seconds
