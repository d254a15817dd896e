"""Ring profile: time one hop around the pool's rings, so the cost model's ring axis is measured.

The runtime's ring attention (``flexsp.runtime.sp.ring``) passes K/V blocks with ``RingComm.hop``: every
rank of a ring sends a buffer to its next rank and receives the previous rank's with one
``batch_isend_irecv``, all rings at once. This sweep runs that very call on the rings of the pool's
largest degree ``D`` (its tiles, ``flexsp.plan.cluster.tile_starts``), at sizes from tiny (where the
per-message latency shows) to large (where the bandwidth does), and takes the slowest rank's time.
``fit_bandwidth(..., what="ring")`` then fits ``time = latency + bytes / bandwidth``, ``bytes`` being
what one rank sends per hop - the unit of ``CostModel.ring_bandwidth``.

Which rings: on one node (``D <= gpus_per_node``) each tile of ``D`` is one ring of consecutive ranks
(intra-node links). Across nodes each tile of ``D`` runs the rings of the ``(gpus_per_node,
D / gpus_per_node)`` split (``flexsp.runtime.sp.ring_comm.ring_blocks``, stride one node): every hop
crosses nodes and every GPU of a node sends at once, as in the hybrids the planner makes where
Ulysses fills a node (or more) and the ring spans nodes - the GPU's share of the NICs, which is what
the analytic models' inter-node ring bandwidth stands for. Ranks in no tile of ``D`` sit the sweep out
(they join the barriers and the max-reduction), as in ``alltoall_sweep``.

GPU path (NCCL; not exercised in CI): the device is synchronised around each timed hop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from flexsp.plan.cluster import tile_starts
from flexsp.profile.bandwidth import agree_on_blocks, link_kind, slowest_seconds
from flexsp.profile.compute import DeviceSetup
from flexsp.runtime.pool import GroupPool
from flexsp.runtime.sp.ring_comm import RingComm, place, ring_blocks


@dataclass(frozen=True)
class RingSample:
    ring: int             # ranks on one ring
    payload_bytes: int    # what one rank sends its next neighbour in one hop
    seconds: float        # slowest rank of every ring, one hop


@dataclass(frozen=True)
class RingLayout:
    """The rings the sweep runs: the tile degree, the first rank of each tile, the stride (Ulysses part
    of the split), every ring's ranks, and the link kind."""

    degree: int
    starts: tuple[int, ...]
    stride: int
    rings: tuple[tuple[int, ...], ...]
    link: str

    @property
    def size(self) -> int:
        return self.degree // self.stride

    def to_dict(self, listed: int = 32) -> dict:
        """JSON for ``meta["ring"]``: the tiles as (first, last) rank, the rings when at most ``listed``."""
        out = {"degree": self.degree, "stride": self.stride, "ring": self.size, "link": self.link,
               "count": len(self.rings), "tiles": [[s, s + self.degree - 1] for s in self.starts]}
        if len(self.rings) <= listed:
            out["rings"] = [list(r) for r in self.rings]
        return out


def ring_layout(world_size: int, degrees: Sequence[int], gpus_per_node: int) -> RingLayout | None:
    """The rings to time in a world pooling ``degrees``; None when no pooled degree exceeds 1."""
    degree = max((d for d in degrees if d > 1), default=None)
    if degree is None:
        return None
    stride = gpus_per_node if degree > gpus_per_node else 1
    starts = tuple(int(x) for x in tile_starts(degree, world_size, gpus_per_node))
    rings = tuple(ring_blocks(world_size, [(stride, degree // stride)], gpus_per_node))
    return RingLayout(degree, starts, stride, rings, link_kind(degree, gpus_per_node))


def ring_sweep(pool: GroupPool, setup: DeviceSetup, sizes: Sequence[int], *, repeats: int = 5,
               warmup: int = 2, progress=None) -> tuple[RingLayout | None, list[RingSample]]:
    """Every rank calls this with the same arguments; every rank gets the same layout and samples back
    (none in a world that pools no degree above 1)."""
    layout = ring_layout(pool.world_size, pool.degrees, pool.gpus_per_node)
    if layout is None:
        return None, []
    tile = agree_on_blocks(pool, layout.degree, setup.device)   # every rank agrees who takes part
    comm = None
    if tile is not None:
        _, ranks, index = place(pool.rank, tile, layout.stride)
        # Point to point addresses global ranks; the world group carries it, whichever rings are pooled.
        comm = RingComm(None, ranks, index)
    element = setup.bytes_per_element
    samples: list[RingSample] = []
    for size in sizes:
        numel = max(1, int(size) // element)
        send = torch.ones(numel, dtype=setup.dtype, device=setup.device)
        for _ in range(warmup if comm is not None else 0):
            comm.hop(send).wait()
        exchange = None if comm is None else lambda: comm.hop(send).wait()
        for _ in range(repeats):         # every ring at once
            samples.append(RingSample(layout.size, numel * element, slowest_seconds(exchange, setup)))
        if progress is not None:
            mine = sorted(s.seconds for s in samples[-repeats:])
            progress(f"ring: {len(layout.rings)} ring(s) of {layout.size} ({layout.link}) {numel * element:>11} B  "
                     f"median {mine[len(mine) // 2] * 1e6:9.1f} us")
    return layout, samples
