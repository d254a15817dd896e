"""The pool of SP process groups: created once, collectively, then looked up by every step.

Creating a communicator is a collective over the whole world and slow (NCCL: hundreds of ms), so a
plan must never create one mid-step. A degree ``d`` has one fixed tiling of the ranks
(``flexsp.plan.cluster.tile_starts``: tiles inside a node when ``d`` is at most the node size, whole
nodes when ``d`` is a multiple of it; for powers of two on power-of-two nodes the aligned blocks
``[k*d, (k+1)*d)``), and a plan's group of degree ``d`` always sits on one tile of ``d``
(docs/design.md, "Plan rules"), so the pool builds exactly those tiles up front, for any degrees
(3, 6, 12, ...), not only powers of two.

Communicators per rank, at most: one per pooled degree > 1 (the tiles of a degree are disjoint),
plus two per hybrid split ``u x r`` with ``u > 1`` and ``r > 1`` (its Ulysses sub-group of ``u``
consecutive ranks and its ring of stride ``u``; a split with ``u = 1`` rings over the tile itself).
Sub-groups that coincide with a pooled tile are shared, so ``stats.per_rank`` can be below the bound
(``communicator_bound``); degree 1 needs none.
Communicators are connected eagerly: NCCL creates them lazily at their first collective, so the
pool runs one tiny all-reduce on each of its groups (and the world) right after creating them;
``pool.stats.seconds`` counts that. ``init_distributed`` starts the world with ``device_id`` on GPUs
so the world communicator is eager too.

Teardown: ``pool.close()`` (or ``with GroupPool() as pool:``) destroys the pool's communicators, last
created first. Whatever is still open when the interpreter exits - failure watcher threads, the
pool's groups, the world - is torn down in that order by a handler each pool registers with
``atexit`` (holding only a weak reference to the pool): left to interpreter shutdown, a watcher
thread caught inside a store call or gloo's threads going down in any order abort the process now
and then (``terminate called without an active exception``), and torchrun reports the job failed.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch
import torch.distributed as dist

from flexsp.errors import PlanError
from flexsp.inputs import integer
from flexsp.plan.cluster import is_tile_start, node_size, tile_starts, tileable
from flexsp.runtime.failures import runs_nccl, stop_watchers
from flexsp.runtime.sp.ring_comm import place, pool_splits, split_blocks

if TYPE_CHECKING:
    from flexsp.plan.cluster import Cluster

_log = logging.getLogger("flexsp.pool")


@dataclass(frozen=True)
class PoolStats:
    """What building the pool cost: groups created world-wide, seconds (creation + eager warm-up),
    communicators this rank holds."""

    count: int
    seconds: float
    per_rank: int
    warmed: bool = False   # each communicator (and the world's) ran a collective inside the timing


def tiles(world_size: int, degrees: Iterable[int], gpus_per_node: int | None = None) -> list[tuple[int, ...]]:
    """Every tile of each degree (``tile_starts``), degrees ascending, in one fixed order (every rank
    must agree). ``gpus_per_node`` None: one node of ``world_size``; then, for powers of two, these
    are the aligned blocks ``[k*d, (k+1)*d)``."""
    g = world_size if gpus_per_node is None else gpus_per_node
    return [tuple(range(int(s), int(s) + d)) for d in sorted(set(degrees)) for s in tile_starts(d, world_size, g)]


def communicator_bound(degrees: Iterable[int], splits: Iterable[tuple[int, int]] = ()) -> int:
    """Communicators one rank holds at most in a pool of ``degrees`` and hybrid ``splits``: one per
    degree > 1, plus a Ulysses sub-group and a ring per split with both parts > 1."""
    return sum(1 for d in set(degrees) if d > 1) + 2 * sum(1 for u, r in set(splits) if u > 1 and r > 1)


def default_gpus_per_node(world_size: int) -> int:
    """The node size torchrun reports (``LOCAL_WORLD_SIZE``), else the whole world as one node."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        local = int(value) if value is not None else 0
    except ValueError:
        raise PlanError(f"LOCAL_WORLD_SIZE={value!r} is not a whole number; pass GroupPool(gpus_per_node=...)") from None
    return local if local >= 1 else world_size


class GroupPool:
    """SP groups for one world, keyed by their ranks; pass it to whoever runs a plan.

    ``degrees`` restricts which degrees get a communicator (default: ``cluster.degrees``, the planner's
    default, when ``cluster`` is given; else every power of two that has a tile); any degree with a tile is accepted - at most the node size, or a multiple of it. The node
    size is ``gpus_per_node``, or ``cluster.gpus_per_node`` (a ``flexsp.Cluster`` of this world), or
    ``LOCAL_WORLD_SIZE`` from torchrun, else the world is one node. Construct the pool on every rank
    at the same point of the program: creation is collective. Without an initialised process group
    the pool describes a world of one rank.

    Ulysses x ring groups: ``splits`` lists the ``(ulysses, ring)`` pairs plans may use (``Group.ring``);
    ``heads`` (the model's query heads) derives them the way the planner does (``ulysses_split``:
    Ulysses part ``gcd(d, heads)``, ring the rest), and so does the older ``ulysses_limit`` for
    power-of-two degrees (every pooled degree ``d`` above it splits ``(limit, d/limit)``). Each split
    adds, on every tile of its degree, the Ulysses sub-groups (``ulysses`` consecutive ranks from the
    tile's start) and the rings of stride ``ulysses``; all are created after the tiles, in one fixed
    order, and a group already created (a sub-group that is a pooled tile) is reused.
    """

    def __init__(self, *, degrees: Iterable[int] | None = None, backend: str | None = None,
                 splits: Iterable[tuple[int, int]] | None = None, ulysses_limit: int | None = None,
                 heads: int | None = None, gpus_per_node: int | None = None, cluster: "Cluster | None" = None,
                 warm_up: bool = True) -> None:
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.gpus_per_node = self._node_size(gpus_per_node, cluster)
        g = self.gpus_per_node
        if degrees is None and cluster is not None:
            chosen = cluster.degrees                            # the planner's default for this cluster
        elif degrees is None:
            chosen = tuple(d for d in (1 << i for i in range(self.world_size.bit_length()))
                           if tileable(d, self.world_size, g))
        else:
            if isinstance(degrees, (str, bytes)) or not isinstance(degrees, Iterable):
                raise PlanError(f"pool degrees must be a collection of whole numbers, got {degrees!r}")
            chosen = tuple(sorted({integer(d, "each pool degree", PlanError) for d in degrees}))   # 1.9 is not 1
            bad = [d for d in chosen if not tileable(d, self.world_size, g)]
            if bad or not chosen:
                raise PlanError(f"pool degrees {bad or list(chosen)} have no tile (world size {self.world_size}, "
                                f"nodes of {node_size(self.world_size, g)} GPUs): a degree must be at most the node "
                                f"size or a multiple of it, and at most the world size")
        self.degrees: tuple[int, ...] = chosen
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._created: set[tuple[int, ...]] = set()
        start = time.perf_counter()
        created = 0
        for ranks in tiles(self.world_size, chosen, g):
            if len(ranks) == 1:
                self._groups[ranks] = None
                continue
            self._created.add(ranks)
            # new_group is collective over the world: every rank calls it for every tile, in order.
            handle = dist.new_group(list(ranks), backend=backend)
            created += 1
            if self.rank in ranks:
                self._groups[ranks] = handle
        self.splits = pool_splits(chosen, splits, ulysses_limit, heads)
        created += self._add_rings(backend)
        held = {id(g) for g in self._groups.values() if g is not None}
        warmed = self._warm_up() if warm_up and dist.is_initialized() else False
        self.stats = PoolStats(count=created, seconds=time.perf_counter() - start, per_rank=len(held), warmed=warmed)
        self.closed = False
        if dist.is_initialized():
            atexit.register(_teardown_at_exit, weakref.ref(self))

    def close(self) -> None:
        """Destroy this pool's communicators, last created first (rings and Ulysses sub-groups, then
        the tiles); idempotent. Local, but call it on every rank once no step uses the pool any more
        (close the executors built on it first: their failure watchers). The world stays up: a new
        pool can be built on it; ``dist.destroy_process_group()`` ends it (at exit, the pool's
        handler does). A closed pool refuses every lookup."""
        if self.closed:
            return
        self.closed = True
        handles = list({id(h): h for h in self._groups.values() if h is not None}.values())
        self._groups = {}
        if not (dist.is_available() and dist.is_initialized()):
            return   # the world went down first, and took every group with it
        for handle in reversed(handles):
            try:
                dist.destroy_process_group(handle)
            except ValueError:
                pass   # already destroyed by its owner

    def __enter__(self) -> "GroupPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _node_size(self, gpus_per_node: int | None, cluster: "Cluster | None") -> int:
        """The node size this pool tiles by; a world of several nodes must be a whole number of them."""
        if cluster is not None:
            if cluster.num_gpus != self.world_size:
                raise PlanError(f"the cluster has {cluster.num_gpus} GPUs but the process group has "
                                f"{self.world_size} ranks")
            if gpus_per_node is not None and int(gpus_per_node) != cluster.gpus_per_node:
                raise PlanError(f"gpus_per_node={gpus_per_node} disagrees with the cluster's {cluster.gpus_per_node}")
            gpus_per_node = cluster.gpus_per_node
        if gpus_per_node is None:
            gpus_per_node = default_gpus_per_node(self.world_size)
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, (int, np.integer)) or gpus_per_node < 1:
            raise PlanError(f"gpus_per_node must be a whole number >= 1, got {gpus_per_node!r}")
        g = int(gpus_per_node)
        if self.world_size > g and self.world_size % g:
            raise PlanError(f"a world of {self.world_size} ranks is not a whole number of nodes of {g} GPUs")
        return g

    def _warm_up(self) -> bool:
        """One small all-reduce on the world and on each of this rank's groups (rings included), in the
        pool's global creation order: members of a group reach it in the same order, so this cannot
        deadlock, and every communicator exists before the first step."""
        device = torch.device("cuda", torch.cuda.current_device()) if runs_nccl() else torch.device("cpu")
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
        """Ulysses sub-groups not pooled as tiles, then every ring; returns how many were created."""
        created = 0
        subs, rings = split_blocks(self.world_size, self.splits, self.gpus_per_node)
        for ranks in subs + rings:
            if ranks in self._created:
                continue   # a sub-group that is a pooled tile, a ring of stride 1 (the tile), or seen before
            handle = dist.new_group(list(ranks), backend=backend)
            self._created.add(ranks)
            created += 1
            if self.rank in ranks:
                self._groups[ranks] = handle
        return created

    @property
    def communicator_bound(self) -> int:
        """The most communicators one rank of this pool can hold (``stats.per_rank`` is at most this)."""
        return communicator_bound(self.degrees, self.splits)

    def ring_groups(self, ranks: Iterable[int], ring: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
        """This rank's (Ulysses sub-group or None for ulysses 1, ring group) in the hybrid group on ``ranks``."""
        ranks = tuple(ranks)
        self.check(ranks, ring)
        if self.rank not in ranks:
            raise PlanError(f"rank {self.rank} asked for SP group {list(ranks)} it does not belong to")
        ulysses_ranks, ring_ranks, _ = place(self.rank, ranks, len(ranks) // ring)
        return (self._groups[ulysses_ranks] if len(ulysses_ranks) > 1 else None), self._groups[ring_ranks]

    def has(self, ranks: Iterable[int]) -> bool:
        """Whether a group on ``ranks`` is pooled (a tile of a pooled degree)."""
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(ranks) not in self.degrees or ranks != tuple(range(ranks[0], ranks[0] + len(ranks))):
            return False
        return bool(is_tile_start(np.array([ranks[0]]), np.array([len(ranks)]), self.world_size, self.gpus_per_node)[0])

    def check(self, ranks: Iterable[int], ring: int = 1) -> None:
        """Raise ``PlanError`` if a plan asks for a group (or a Ulysses x ring split) the pool does not hold."""
        ranks = tuple(ranks)
        if self.closed:
            raise PlanError(f"SP group on ranks {list(ranks)} asked of a closed GroupPool; build a new pool")
        if not self.has(ranks):
            g = node_size(self.world_size, self.gpus_per_node)
            raise PlanError(f"SP group on ranks {list(ranks)} is not in the pool: pooled groups are the tiles of "
                            f"degrees {list(self.degrees)} in a world of {self.world_size} (consecutive ranks from a "
                            f"multiple of the degree inside a node of {g}, or whole nodes)")
        if ring > 1 and (len(ranks) // ring, ring) not in self.splits:
            raise PlanError(f"SP group on ranks {list(ranks)} runs {len(ranks) // ring} x {ring} (Ulysses x ring) but "
                            f"the pool holds the splits {[f'{u} x {r}' for u, r in self.splits] or 'none'}; build "
                            f"GroupPool(splits=...) or GroupPool(heads=...) to match the plan")

    def get(self, ranks: Iterable[int]) -> dist.ProcessGroup | None:
        """The communicator for ``ranks`` (this rank must be one of them); None for degree 1."""
        ranks = tuple(ranks)
        self.check(ranks)
        if self.rank not in ranks:
            raise PlanError(f"rank {self.rank} asked for SP group {list(ranks)} it does not belong to")
        return self._groups.get(ranks) if len(ranks) > 1 else None

    def __repr__(self) -> str:
        s = self.stats
        return (f"GroupPool(world_size={self.world_size}, gpus_per_node={self.gpus_per_node}, "
                f"degrees={list(self.degrees)}, groups={s.count}, per_rank={s.per_rank}, seconds={s.seconds:.3f})")


def _teardown_at_exit(pool: "weakref.ref[GroupPool]") -> None:
    """At interpreter exit, in order: every failure watcher thread, this pool's groups, the world.

    No barrier: a teardown at exit must never wait on a rank that crashed. Errors are logged, never
    raised (the training already finished). The first pool's handler to run ends the world; the
    others find it gone and only stop what is theirs."""
    try:
        stop_watchers()
        live = pool()
        if live is not None:
            live.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:   # at exit there is no caller left to handle it
        _log.warning("flexsp: process-group teardown at exit failed: %s: %s", type(exc).__name__, exc)


def init_distributed(timeout: float = 600.0) -> torch.device:
    """Start the default process group from torchrun's environment and return this rank's device. On GPUs:
    NCCL with ``device_id``, so the world communicator is created now rather than inside the first step; on
    CPUs: gloo. Without a launch (no ``WORLD_SIZE`` or ``RANK``), a world of one over an in-process store: no
    port is taken and the environment is left alone, so a script or test that starts other worlds later (their
    own torchrun, the default port 29500) does not collide with it."""
    if dist.is_initialized():
        raise PlanError("the default process group is already initialised")
    launched = "WORLD_SIZE" in os.environ or "RANK" in os.environ
    world: dict = {}
    if launched:
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)
    else:
        world = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=timeout), **world)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout), **world)
    return device
