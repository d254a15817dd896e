"""Per-degree time and memory coefficients: the only view of the cost model the solver sees.

A sequence of ``s`` tokens in an SP group of degree ``d`` takes ``quad[d] * s**2 + lin[d] * s``
seconds; a group takes the sum over its sequences plus ``beta1``; a group of degree ``d`` holds at
most ``capacity[d]`` tokens. Any model of that shape plugs in (the paper's alpha-beta model, an
analytic one, a profiled one) without the solver knowing which.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DegreeCosts:
    degrees: tuple[int, ...]        # ascending powers of two
    quad: tuple[float, ...]         # seconds per token^2, per degree
    lin: tuple[float, ...]          # seconds per token, per degree
    capacity: tuple[float, ...]     # tokens one group of this degree can hold
    beta1: float                    # seconds per group per micro-batch

    def __post_init__(self) -> None:
        n = len(self.degrees)
        if n == 0 or not (len(self.quad) == len(self.lin) == len(self.capacity) == n):
            raise ValueError("DegreeCosts needs one quad, lin and capacity entry per degree")
        if list(self.degrees) != sorted(set(self.degrees)):
            raise ValueError(f"degrees must be strictly ascending, got {self.degrees}")

    @property
    def num_degrees(self) -> int:
        return len(self.degrees)

    def index(self, degree: int) -> int:
        return self.degrees.index(degree)

    def times(self, lengths: np.ndarray) -> np.ndarray:
        """``[len(lengths), num_degrees]`` seconds; ``inf`` where one sequence alone overflows memory."""
        s = np.asarray(lengths, dtype=np.float64)[:, None]
        quad = np.asarray(self.quad)[None, :]
        lin = np.asarray(self.lin)[None, :]
        out = quad * s * s + lin * s
        out[s > np.asarray(self.capacity)[None, :]] = np.inf
        return out

    def seq_time(self, lengths: np.ndarray, k: int) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        return self.quad[k] * s * s + self.lin[k] * s

    def group_time(self, lengths: np.ndarray, k: int) -> float:
        return float(self.seq_time(lengths, k).sum()) + self.beta1

    def min_memory_degree(self, lengths: np.ndarray) -> np.ndarray:
        """Index of the smallest degree whose group can hold each sequence alone (-1: none can)."""
        s = np.asarray(lengths, dtype=np.float64)
        fits = s[:, None] <= np.asarray(self.capacity)[None, :]
        return np.where(fits.any(axis=1), fits.argmax(axis=1), -1)

    def restricted(self, max_degree: int) -> "DegreeCosts":
        keep = [i for i, d in enumerate(self.degrees) if d <= max_degree]
        return DegreeCosts(tuple(self.degrees[i] for i in keep), tuple(self.quad[i] for i in keep),
                           tuple(self.lin[i] for i in keep), tuple(self.capacity[i] for i in keep),
                           self.beta1)
