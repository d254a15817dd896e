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


def group_loads(members: list[np.ndarray], degree_idx: np.ndarray, lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    """Seconds of sequences in each group (no beta1); ``degree_idx`` indexes ``costs.degrees``.
    Vectorised over all sequences at once."""
    owner = np.repeat(np.arange(len(members)), [len(m) for m in members])
    per_seq = costs.seconds(lengths[np.concatenate(members)], np.asarray(degree_idx)[owner])
    return np.bincount(owner, weights=per_seq, minlength=len(members))


def group_times(groups: tuple[GroupAssignment, ...], lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    """Seconds of every group of a micro-batch, beta1 included."""
    degree_idx = [costs.index(g.degree) for g in groups]
    return group_loads([g.seq_ids for g in groups], degree_idx, lengths, costs) + costs.beta1


@dataclass(frozen=True)
class Schedule:
    """Micro-batches run one after another; the groups of one micro-batch run side by side."""

    micro_batches: tuple[tuple[GroupAssignment, ...], ...]

    def micro_batch_times(self, lengths: np.ndarray, costs: DegreeCosts) -> list[float]:
        """Slowest group of each micro-batch; one vectorised pass over every group of the plan."""
        groups = [g for mb in self.micro_batches for g in mb]
        if not groups:
            return []
        index = {d: k for k, d in enumerate(costs.degrees)}
        loads = group_loads([g.seq_ids for g in groups], [index[g.degree] for g in groups], lengths, costs) + costs.beta1
        owner = np.repeat(np.arange(len(self.micro_batches)), [len(mb) for mb in self.micro_batches])
        slowest = np.full(len(self.micro_batches), -np.inf)
        np.maximum.at(slowest, owner, loads)
        return slowest.tolist()

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return float(sum(self.micro_batch_times(lengths, costs)))

    @property
    def num_sequences(self) -> int:
        return sum(len(g.seq_ids) for mb in self.micro_batches for g in mb)
