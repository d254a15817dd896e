"""Communication profile: time ``all_to_all_single`` on every pooled SP group size of this world.

Run under ``torchrun`` (or any initialised process group). For each degree ``d > 1`` of the
``GroupPool``, every tile of ``d`` ranks (``flexsp.plan.cluster.tile_starts``) exchanges at the same moment - as in a real step,
where the whole cluster communicates at once - and a run's time is the slowest rank's. ``bytes`` is
one rank's send buffer, the unit of ``CostModel.alltoall_bandwidth``. Whether a degree crosses nodes
follows from the topology: ``d <= gpus_per_node`` is intra-node (tiles stay inside a node).
Ranks in no tile of ``d`` (the tail of a world of 3, 6, 24 or 48 ranks at a power of two; a node's
leftover ranks at a degree that does not divide it) sit degree ``d`` out: they join the barriers and the max-reduction with nothing to time, and every rank
checks that all agree on who takes part before the first exchange.

GPU path (NCCL; not exercised in CI): the device is synchronised around each timed exchange.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flexsp.errors import CostModelError
from flexsp.plan.cluster import tile_starts
from flexsp.profile.compute import DeviceSetup
from flexsp.runtime.pool import GroupPool


@dataclass(frozen=True)
class CommSample:
    degree: int
    payload_bytes: int    # one rank's send buffer
    seconds: float        # slowest rank of the slowest group, one exchange


def link_kind(degree: int, gpus_per_node: int) -> str:
    return "intra-node" if degree <= gpus_per_node else "inter-node"


def block_of(rank: int, world_size: int, degree: int, gpus_per_node: int | None = None) -> tuple[int, ...] | None:
    """The tile of ``degree`` holding ``rank`` (the pool's group), or None if ``rank`` is in none.
    ``gpus_per_node`` None: one node of ``world_size``."""
    if degree < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise CostModelError(f"no block for rank {rank} of a world of {world_size} at degree {degree}")
    starts = tile_starts(degree, world_size, world_size if gpus_per_node is None else gpus_per_node)
    k = int(starts.searchsorted(rank, side="right")) - 1
    return tuple(range(int(starts[k]), int(starts[k]) + degree)) if k >= 0 and rank < starts[k] + degree else None


def participants(world_size: int, degree: int, gpus_per_node: int | None = None) -> int:
    """How many ranks take part in degree ``degree``: every tile's."""
    return len(tile_starts(degree, world_size, world_size if gpus_per_node is None else gpus_per_node)) * degree


def agree_on_blocks(pool: GroupPool, degree: int, device: torch.device) -> tuple[int, ...] | None:
    """This rank's tile of ``degree`` after every rank has confirmed the same split (one all-reduce)."""
    block = block_of(pool.rank, pool.world_size, degree, pool.gpus_per_node)
    count = torch.tensor([0 if block is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(count)
    expected = participants(pool.world_size, degree, pool.gpus_per_node)
    if int(count.item()) != expected:
        raise CostModelError(f"ranks disagree on who takes part in degree {degree}: {int(count.item())} say they "
                             f"do, {expected} should (world of {pool.world_size})")
    return block


def slowest_seconds(exchange: Callable[[], None] | None, setup: DeviceSetup) -> float:
    """One exchange started on every rank at once (a barrier, as in a real step, where the whole cluster
    communicates together), timed with the device synchronised; the slowest rank's seconds. Ranks that
    sit out (``exchange`` None) join the barrier and the max-reduction and report 0."""
    dist.barrier()
    setup.sync()
    t0 = time.perf_counter()
    if exchange is not None:
        exchange()
    setup.sync()
    elapsed = time.perf_counter() - t0 if exchange is not None else 0.0
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=setup.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def alltoall_sweep(pool: GroupPool, setup: DeviceSetup, sizes: Sequence[int], *, repeats: int = 5,
                   warmup: int = 2, progress=None) -> list[CommSample]:
    """Every rank calls this with the same arguments; every rank gets the same samples back."""
    samples: list[CommSample] = []
    element = setup.bytes_per_element
    for degree in (d for d in pool.degrees if d > 1):
        block = agree_on_blocks(pool, degree, setup.device)
        group = pool.get(block) if block is not None else None
        for size in sizes:
            numel = max(degree, int(size) // element // degree * degree)   # divisible into d chunks
            send = torch.ones(numel, dtype=setup.dtype, device=setup.device)
            recv = torch.empty_like(send)
            for _ in range(warmup if block is not None else 0):
                dist.all_to_all_single(recv, send, group=group)
            exchange = None if block is None else lambda: dist.all_to_all_single(recv, send, group=group)
            for _ in range(repeats):     # all groups of this degree at once
                samples.append(CommSample(degree, numel * element, slowest_seconds(exchange, setup)))
            if progress is not None:
                mine = sorted(s.seconds for s in samples[-repeats:])
                sat_out = pool.world_size - participants(pool.world_size, degree, pool.gpus_per_node)
                if sat_out and size == sizes[0]:
                    progress(f"all-to-all: degree {degree}: {sat_out} of {pool.world_size} ranks are in no tile "
                             f"of it and sit it out")
                progress(f"all-to-all: degree {degree:>3}  {numel * element:>11} B  median {mine[len(mine) // 2] * 1e3:8.3f} ms")
    return samples
