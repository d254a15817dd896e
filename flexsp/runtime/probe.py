"""The executor's measurement hooks: a ``StepProbe`` is called at a few points of every step.

``StepExecutor(..., probe=...)`` calls it at step begin (before the checks), after the agreement
all-reduce, at the start, forward end and end of each micro-batch, and after the optimizer step.
The base class does nothing, so an executor without a probe pays a few no-op calls per step;
``flexsp.telemetry.StepRecorder`` is the implementation that times them (CUDA events on a GPU,
``perf_counter`` on a CPU, never a host sync inside a layer).
"""
from __future__ import annotations

from typing import Any

from flexsp.plan.types import Group, Plan


class StepProbe:
    """No-op hooks; override the ones you need. Called on the training thread, in this order per step."""

    def step_begin(self, plan: Plan, source: Any) -> None:
        """A step on ``plan`` starts; ``source`` is the loader's ``Step`` or ``run_plan``'s global batch."""

    def checked(self) -> None:
        """Every rank passed the agreement all-reduce: the step's collectives start now."""

    def micro_batch_begin(self, index: int, group: Group | None, real_tokens: int) -> None:
        """Micro-batch ``index`` starts; ``group`` is this rank's group (None: it idles on a dummy shard)."""

    def forward_end(self, index: int) -> None:
        """The micro-batch's forward (loss) is computed; its backward starts."""

    def micro_batch_end(self, index: int) -> None:
        """The micro-batch's backward has been issued."""

    def step_end(self, result: Any) -> None:
        """The optimizer step is done; ``result`` is the ``StepResult``."""


NO_PROBE = StepProbe()
