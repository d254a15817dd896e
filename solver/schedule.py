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


def group_times(groups: tuple[GroupAssignment, ...], lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    """Seconds of every group of a micro-batch, beta1 included (vectorised over all sequences)."""
    sizes = [len(g.seq_ids) for g in groups]
    owner = np.repeat(np.arange(len(groups)), sizes)
    k = np.array([costs.index(g.degree) for g in groups])[owner]
    per_seq = costs.seconds(lengths[np.concatenate([g.seq_ids for g in groups])], k)
    return np.bincount(owner, weights=per_seq, minlength=len(groups)) + costs.beta1


@dataclass(frozen=True)
class Schedule:
    """Micro-batches run one after another; the groups of one micro-batch run side by side."""

    micro_batches: tuple[tuple[GroupAssignment, ...], ...]

    def micro_batch_times(self, lengths: np.ndarray, costs: DegreeCosts) -> list[float]:
        return [float(group_times(mb, lengths, costs).max()) for mb in self.micro_batches]

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return float(sum(self.micro_batch_times(lengths, costs)))

    @property
    def num_sequences(self) -> int:
        return sum(len(g.seq_ids) for mb in self.micro_batches for g in mb)
