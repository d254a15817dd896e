"""The GPU topology a plan is made for: how many GPUs and how they are grouped into nodes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from flexsp.errors import ClusterError, PlanError
from flexsp.inputs import integer

MAX_GPUS = 2**40    # far above any cluster; keeps every per-rank array the planner builds small


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


def power_of_two_degrees(num_gpus: int) -> tuple[int, ...]:
    """Every power-of-two SP degree up to ``num_gpus``, ascending: the one list of degrees a world allows."""
    return tuple(1 << i for i in range(int(num_gpus).bit_length()))


# --- the aligned-block rule: the one place that says which ranks an SP group of degree d may use ---
def aligned_block(index: int, degree: int) -> tuple[int, ...]:
    """Ranks of the ``index``-th aligned block of ``degree``: ``[index*degree, (index+1)*degree)``.

    Aligned blocks of power-of-two degrees nest, so a group of at most a node's GPUs never spans
    nodes, and the runtime can pre-create every group a plan may ask for."""
    return tuple(range(index * degree, (index + 1) * degree))


def misaligned(ranks: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Vectorised rule over many groups: ``ranks`` is every group's ranks concatenated, ``degrees``
    each group's size; True for each rank that breaks its group's aligned block (its group's first
    rank not a multiple of the degree, or the ranks not consecutive from it)."""
    ranks, degrees = np.asarray(ranks, dtype=np.int64), np.asarray(degrees, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(degrees)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(len(degrees)), degrees)
    first = ranks[starts][owner]
    return (ranks != first + np.arange(len(ranks)) - starts[owner]) | (first % degrees[owner] != 0)


def is_aligned_block(ranks: Sequence[int]) -> bool:
    """Whether ``ranks`` is one aligned block ``aligned_block(k, len(ranks))`` of a power-of-two size."""
    ranks = tuple(int(r) for r in ranks)
    return is_power_of_two(len(ranks)) and not misaligned(np.asarray(ranks), np.asarray([len(ranks)])).any()


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs in nodes of ``gpus_per_node``.

    SP groups are power-of-two blocks of ranks; a group that fits in a node must stay in one, which
    aligned blocks guarantee when the node size is a power of two and the GPU count is a whole number
    of nodes (or one partial node). The GPU count itself need not be a power of two (48 = 6 nodes).
    """

    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node"):
            object.__setattr__(self, name, integer(getattr(self, name), name, ClusterError, maximum=MAX_GPUS))
        if not is_power_of_two(self.gpus_per_node):
            raise ClusterError(
                f"gpus_per_node must be a power of two so aligned SP groups stay inside nodes, "
                f"got {self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ClusterError(
                f"num_gpus={self.num_gpus} spans several nodes but is not a multiple of "
                f"gpus_per_node={self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Every power-of-two SP degree that fits in the cluster, ascending."""
        return power_of_two_degrees(self.num_gpus)

    def usable_degrees(self, max_degree: int | None = None, degrees: Iterable[int] | None = None) -> tuple[int, ...]:
        """The SP degrees a plan may use: powers of two up to N, optionally at most ``max_degree`` and
        only those in ``degrees`` (each degree in use costs every member rank a communicator)."""
        usable = self.degrees
        if degrees is not None:
            wanted = sorted(set(int(d) for d in degrees))
            bad = [d for d in wanted if d not in self.degrees]
            if bad or not wanted:
                raise PlanError(f"degrees {bad or wanted} are not usable: choose powers of two from {list(self.degrees)}")
            usable = tuple(wanted)
        if max_degree is not None:
            usable = tuple(d for d in usable if d <= max_degree)
            if not usable:
                raise PlanError(f"max_degree={max_degree} leaves no SP degree (need >= 1)")
        return usable
