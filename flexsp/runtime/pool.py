"""The pool of SP process groups: created once, collectively, then looked up by every step.

Creating a communicator is a collective over the whole world and slow (NCCL: hundreds of ms), so a
plan must never create one mid-step. Plans place a group of degree ``d`` on an aligned block of ranks
``[k*d, (k+1)*d)`` (docs/design.md, "Plan rules"), so the pool builds exactly those blocks up front: each rank then
holds one communicator per degree > 1, at most ``log2(N)`` of them. Degree 1 needs none.
Communicators are connected eagerly: NCCL creates them lazily at their first collective, so the
pool runs one tiny all-reduce on each of its groups (and the world) right after creating them;
``pool.stats.seconds`` counts that. ``init_distributed`` starts the world with ``device_id`` on GPUs
so the world communicator is eager too.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from flexsp.errors import PlanError
from flexsp.plan.cluster import aligned_block, is_aligned_block, power_of_two_degrees
from flexsp.runtime.sp.ring_comm import place, pool_splits, ring_blocks


@dataclass(frozen=True)
class PoolStats:
    """What building the pool cost: groups created world-wide, seconds (creation + eager warm-up),
    communicators this rank holds."""

    count: int
    seconds: float
    per_rank: int
    warmed: bool = False   # each communicator (and the world's) ran a collective inside the timing


def aligned_blocks(world_size: int, degrees: Iterable[int]) -> list[tuple[int, ...]]:
    """Every aligned block of ranks for each degree, in one fixed order (every rank must agree)."""
    blocks = []
    for d in sorted(set(degrees)):
        blocks.extend(aligned_block(k, d) for k in range(world_size // d))
    return blocks


class GroupPool:
    """SP groups for one world, keyed by their ranks; pass it to whoever runs a plan.

    ``degrees`` restricts which degrees get a communicator (default: every power of two up to the
    world size). Construct it on every rank at the same point of the program: creation is collective.
    Without an initialised process group the pool describes a world of one rank.

    Ulysses x ring groups: ``splits`` lists the ``(ulysses, ring)`` pairs plans may use (``Group.ring``),
    or ``ulysses_limit`` (the cost model's ``ulysses_limit``: the largest power of two dividing the
    heads) derives them the way the planner does - every pooled degree ``d`` above it splits
    ``(limit, d/limit)``. Each split adds the Ulysses sub-groups (aligned blocks of degree ``ulysses``)
    and the rings of stride ``ulysses``; all are created after the plain blocks, in one fixed order.
    """

    def __init__(self, *, degrees: Iterable[int] | None = None, backend: str | None = None,
                 splits: Iterable[tuple[int, int]] | None = None, ulysses_limit: int | None = None,
                 warm_up: bool = True) -> None:
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        possible = power_of_two_degrees(self.world_size)
        if degrees is None:
            chosen = possible
        else:
            chosen = tuple(sorted(set(int(d) for d in degrees)))
            bad = [d for d in chosen if d not in possible]
            if bad:
                raise PlanError(f"pool degrees {bad} are not powers of two <= world size {self.world_size}; "
                                f"valid degrees are {list(possible)}")
        self.degrees: tuple[int, ...] = chosen
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._created: set[tuple[int, ...]] = set()
        start = time.perf_counter()
        created = 0
        for ranks in aligned_blocks(self.world_size, chosen):
            if len(ranks) == 1:
                self._groups[ranks] = None
                continue
            self._created.add(ranks)
            # new_group is collective over the world: every rank calls it for every block, in order.
            handle = dist.new_group(list(ranks), backend=backend)
            created += 1
            if self.rank in ranks:
                self._groups[ranks] = handle
        self.splits = pool_splits(chosen, splits, ulysses_limit)
        created += self._add_rings(backend)
        held = {id(g) for g in self._groups.values() if g is not None}
        warmed = self._warm_up() if warm_up and dist.is_initialized() else False
        self.stats = PoolStats(count=created, seconds=time.perf_counter() - start, per_rank=len(held), warmed=warmed)

    def _warm_up(self) -> bool:
        """One small all-reduce on the world and on each of this rank's groups (rings included), in the
        pool's global creation order: members of a group reach it in the same order, so this cannot
        deadlock, and every communicator exists before the first step."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        seen: set[int] = set()
        for handle in self._groups.values():
            if handle is not None and id(handle) not in seen:
                seen.add(id(handle))
                dist.all_reduce(probe, group=handle)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return True

    def _add_rings(self, backend: str | None) -> int:
        """Ulysses sub-groups not pooled as plain blocks, then every ring; returns how many were created."""
        created = 0
        extra = sorted({u for u, _ in self.splits if u > 1} - set(self.degrees))
        rings = ring_blocks(self.world_size, self.splits)
        for ranks in aligned_blocks(self.world_size, extra) + rings:
            if ranks in self._created:
                continue   # a ring of stride 1 is the plain block itself
            handle = dist.new_group(list(ranks), backend=backend)
            self._created.add(ranks)
            created += 1
            if self.rank in ranks:
                self._groups[ranks] = handle
        return created

    def ring_groups(self, ranks: Iterable[int], ring: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
        """This rank's (Ulysses sub-group or None for ulysses 1, ring group) in the hybrid group on ``ranks``."""
        ranks = tuple(ranks)
        self.check(ranks, ring)
        if self.rank not in ranks:
            raise PlanError(f"rank {self.rank} asked for SP group {list(ranks)} it does not belong to")
        ulysses_ranks, ring_ranks, _ = place(self.rank, ranks, len(ranks) // ring)
        return (self._groups[ulysses_ranks] if len(ulysses_ranks) > 1 else None), self._groups[ring_ranks]

    def has(self, ranks: Iterable[int]) -> bool:
        """Whether a group on ``ranks`` is pooled (aligned block of a pooled degree)."""
        ranks = tuple(ranks)
        return bool(ranks) and len(ranks) in self.degrees and is_aligned_block(ranks) and ranks[-1] < self.world_size

    def check(self, ranks: Iterable[int], ring: int = 1) -> None:
        """Raise ``PlanError`` if a plan asks for a group (or a Ulysses x ring split) the pool does not hold."""
        ranks = tuple(ranks)
        if not self.has(ranks):
            raise PlanError(f"SP group on ranks {list(ranks)} is not in the pool: pooled groups are aligned "
                            f"blocks [k*d, (k+1)*d) of degrees {list(self.degrees)} in a world of {self.world_size}")
        if ring > 1 and (len(ranks) // ring, ring) not in self.splits:
            raise PlanError(f"SP group on ranks {list(ranks)} runs {len(ranks) // ring} x {ring} (Ulysses x ring) but "
                            f"the pool holds the splits {[f'{u} x {r}' for u, r in self.splits] or 'none'}; build "
                            f"GroupPool(splits=...) or GroupPool(ulysses_limit=...) to match the plan")

    def get(self, ranks: Iterable[int]) -> dist.ProcessGroup | None:
        """The communicator for ``ranks`` (this rank must be one of them); None for degree 1."""
        ranks = tuple(ranks)
        self.check(ranks)
        if self.rank not in ranks:
            raise PlanError(f"rank {self.rank} asked for SP group {list(ranks)} it does not belong to")
        return self._groups.get(ranks) if len(ranks) > 1 else None

    def __repr__(self) -> str:
        s = self.stats
        return (f"GroupPool(world_size={self.world_size}, degrees={list(self.degrees)}, groups={s.count}, "
                f"per_rank={s.per_rank}, seconds={s.seconds:.3f})")


def init_distributed(timeout: float = 600.0) -> torch.device:
    """Start the default process group from torchrun's environment (a world of one without it) and
    return this rank's device. On GPUs: NCCL with ``device_id``, so the world communicator is created
    now rather than inside the first step; on CPUs: gloo."""
    if dist.is_initialized():
        raise PlanError("the default process group is already initialised")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=timeout))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return device
