"""Communication profile: time ``all_to_all_single`` on every pooled SP group size of this world.

Run under ``torchrun`` (or any initialised process group). For each degree ``d > 1`` of the
``GroupPool``, every aligned block of ``d`` ranks exchanges at the same moment - as in a real step,
where the whole cluster communicates at once - and a run's time is the slowest rank's. ``bytes`` is
one rank's send buffer, the unit of ``CostModel.alltoall_bandwidth``. Whether a degree crosses nodes
follows from the topology: ``d <= gpus_per_node`` is intra-node (aligned blocks stay inside a node).

GPU path (NCCL; not exercised in CI): the device is synchronised around each timed exchange.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..runtime.groups import GroupPool
from .compute import DeviceSetup


@dataclass(frozen=True)
class CommSample:
    degree: int
    payload_bytes: int    # one rank's send buffer
    seconds: float        # slowest rank of the slowest group, one exchange


def link_kind(degree: int, gpus_per_node: int) -> str:
    return "intra-node" if degree <= gpus_per_node else "inter-node"


def alltoall_sweep(pool: GroupPool, setup: DeviceSetup, sizes: Sequence[int], *, repeats: int = 5,
                   warmup: int = 2, progress=None) -> list[CommSample]:
    """Every rank calls this with the same arguments; every rank gets the same samples back."""
    samples: list[CommSample] = []
    rank, element = pool.rank, setup.bytes_per_element
    for degree in (d for d in pool.degrees if d > 1):
        start = rank // degree * degree
        group = pool.get(tuple(range(start, start + degree)))
        for size in sizes:
            numel = max(degree, int(size) // element // degree * degree)   # divisible into d chunks
            send = torch.ones(numel, dtype=setup.dtype, device=setup.device)
            recv = torch.empty_like(send)
            for _ in range(warmup):
                dist.all_to_all_single(recv, send, group=group)
            for _ in range(repeats):
                dist.barrier()    # all groups of this degree start together
                setup.sync()
                t0 = time.perf_counter()
                dist.all_to_all_single(recv, send, group=group)
                setup.sync()
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=setup.device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                samples.append(CommSample(degree, numel * element, float(slowest.item())))
            if progress is not None:
                mine = sorted(s.seconds for s in samples[-repeats:])
                progress(f"all-to-all: degree {degree:>3}  {numel * element:>11} B  median {mine[len(mine) // 2] * 1e3:8.3f} ms")
    return samples
