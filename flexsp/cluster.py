"""The GPU topology a plan is made for: how many GPUs and how they are grouped into nodes."""
from __future__ import annotations

from dataclasses import dataclass

from .checks import integer
from .errors import ClusterError

MAX_GPUS = 2**40    # far above any cluster; keeps every per-rank array the planner builds small


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


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
        out, degree = [], 1
        while degree <= self.num_gpus:
            out.append(degree)
            degree *= 2
        return tuple(out)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node
