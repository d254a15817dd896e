"""A local stand-in for the Ulysses all-to-all: the post-exchange shapes of one rank, no process group.

In a group of ``d`` ranks, rank ``r`` sends head chunk ``j`` of its token shard to rank ``j`` and gets
back every rank's tokens of head chunk ``r``. One device cannot see the other ranks' tokens, but the
work that follows depends only on shapes, so the stand-in fills every token block with this rank's
own block: ``seq_to_head`` turns ``[tokens/d, heads, dim]`` into ``[tokens, heads/d, dim]`` whose
block ``r`` is exactly what the real exchange puts there, and ``head_to_seq`` turns
``[tokens, heads/d, dim]`` into ``[tokens/d, heads, dim]`` whose head chunk ``r`` is exact. Both are
differentiable (their backward is the matching copy), and the copies cost about what the real
exchange's local packing costs; the transfer itself is what ``flexsp.replay`` models from bandwidths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LocalExchange:
    """Rank ``rank`` of a Ulysses group of ``degree`` ranks, simulated on one device."""

    degree: int
    rank: int

    def __post_init__(self) -> None:
        if self.degree < 1 or not 0 <= self.rank < self.degree:
            raise ValueError(f"local rank {self.rank} is outside 0..{self.degree - 1} (degree {self.degree})")

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens/d, heads, dim]`` -> ``[tokens, heads/d, dim]``."""
        d = self.degree
        if d == 1:
            return x
        _check(x, 1, d)
        per = x.shape[1] // d
        return x.narrow(1, self.rank * per, per).repeat(d, 1, 1)

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads/d, dim]`` -> ``[tokens/d, heads, dim]``."""
        d = self.degree
        if d == 1:
            return x
        _check(x, 0, d)
        per = x.shape[0] // d
        return x.narrow(0, self.rank * per, per).repeat(1, d, 1)


def _check(x: torch.Tensor, dim: int, d: int) -> None:
    # The real exchange refuses the same inputs (``flexsp.runtime.sp.ulysses_comm``).
    if x.dim() != 3 or x.shape[dim] % d:
        raise ValueError(f"all-to-all over {d} ranks needs dim {dim} divisible by {d}, got shape {tuple(x.shape)}")
