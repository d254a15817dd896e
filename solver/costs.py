"""Per-degree time and memory coefficients: the only view of the cost model the solver sees.

A sequence of ``s`` tokens in an SP group of degree ``d`` takes
``lin[d] * s + max(quad[d] * s**2, ring[d] * s)`` seconds: attention (``quad``) overlaps the
point-to-point KV passing of a ring axis (``ring``, zero for pure Ulysses groups). A group takes
the sum over its sequences plus ``beta1``; a group of degree ``d`` holds at most ``capacity[d]``
tokens. Any model of that shape plugs in (the paper's alpha-beta model, an analytic one, a
profiled one, a Ulysses x ring hybrid) without the solver knowing which.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def seconds(s, quad, lin, ring=0.0):
    """The one time formula, vectorised: ``lin*s + max(quad*s^2, ring*s)``."""
    s = np.asarray(s, dtype=np.float64)
    return lin * s + np.maximum(quad * s * s, ring * s)


@dataclass(frozen=True)
class DegreeCosts:
    degrees: tuple[int, ...]        # ascending powers of two
    quad: tuple[float, ...]         # seconds per token^2, per degree
    lin: tuple[float, ...]          # seconds per token, per degree
    capacity: tuple[float, ...]     # tokens one group of this degree can hold
    beta1: float                    # seconds per group per micro-batch
    ring: tuple[float, ...] = ()    # seconds per token of ring KV passing (empty: no ring axis)

    def __post_init__(self) -> None:
        n = len(self.degrees)
        if not self.ring:
            object.__setattr__(self, "ring", (0.0,) * n)
        if n == 0 or not (len(self.quad) == len(self.lin) == len(self.capacity) == len(self.ring) == n):
            raise ValueError("DegreeCosts needs one quad, lin, ring and capacity entry per degree")
        if list(self.degrees) != sorted(set(self.degrees)):
            raise ValueError(f"degrees must be strictly ascending, got {self.degrees}")
        for name in ("quad", "lin", "ring"):
            object.__setattr__(self, f"_{name}", np.asarray(getattr(self, name), dtype=np.float64))

    def seconds(self, lengths, k) -> np.ndarray:
        """Seconds of sequences at degree index ``k`` (an int or an array broadcast with ``lengths``)."""
        return seconds(lengths, self._quad[k], self._lin[k], self._ring[k])

    @property
    def num_degrees(self) -> int:
        return len(self.degrees)

    def index(self, degree: int) -> int:
        return self.degrees.index(degree)

    def times(self, lengths: np.ndarray) -> np.ndarray:
        """``[len(lengths), num_degrees]`` seconds; ``inf`` where one sequence alone overflows memory."""
        s = np.asarray(lengths, dtype=np.float64)[:, None]
        out = self.seconds(s, np.arange(self.num_degrees)[None, :])
        out[s > np.asarray(self.capacity)[None, :]] = np.inf
        return out

    def seq_time(self, lengths: np.ndarray, k: int) -> np.ndarray:
        return self.seconds(lengths, k)

    def group_time(self, lengths: np.ndarray, k: int) -> float:
        return float(self.seq_time(lengths, k).sum()) + self.beta1
