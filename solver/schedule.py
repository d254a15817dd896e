"""What the solver returns: micro-batches of (degree, sequence ids) groups, with no ranks attached."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costs import DegreeCosts


@dataclass(frozen=True)
class GroupAssignment:
    degree: int
    seq_ids: np.ndarray  # int64 indices into the batch's lengths

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return costs.group_time(lengths[self.seq_ids], costs.index(self.degree))


@dataclass(frozen=True)
class Schedule:
    """Micro-batches run one after another; the groups of one micro-batch run side by side."""

    micro_batches: tuple[tuple[GroupAssignment, ...], ...]

    def micro_batch_times(self, lengths: np.ndarray, costs: DegreeCosts) -> list[float]:
        return [max(g.time(lengths, costs) for g in mb) for mb in self.micro_batches]

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return float(sum(self.micro_batch_times(lengths, costs)))

    @property
    def num_sequences(self) -> int:
        return sum(len(g.seq_ids) for mb in self.micro_batches for g in mb)
