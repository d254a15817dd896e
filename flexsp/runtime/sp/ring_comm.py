"""Point-to-point for the ring axis: which ranks form rings, and one non-blocking hop around a ring.

A ``ulysses x ring`` group sits on a tile of ``d = ulysses * ring`` ranks starting at ``s``
(``flexsp.plan.cluster.tile_starts``: inside a node, or whole nodes; for powers of two on power-of-two
nodes the aligned block ``[k*d, (k+1)*d)``). It has ``ring`` Ulysses sub-groups of ``ulysses``
consecutive ranks from the tile's start (``s + i*ulysses + [0, ulysses)``) and ``ulysses`` rings of
stride ``ulysses``: ``{s + j + ulysses*t : t < ring}``. Neither part needs to be a power of two (a ring
of 3 or 5, a Ulysses part of 3 or 6 that divides the heads). Consecutive ranks share the all-to-all -
on a real machine the node's fast links - and the ring's point-to-point crosses the slower ones.

``RingComm.hop(x)`` sends ``x`` to the next ring rank and receives the previous one's tensor of the same
shape with one ``batch_isend_irecv``; the caller waits only when it needs the data, so the transfer
runs while it computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from flexsp.errors import PlanError
from flexsp.inputs import integer
from flexsp.plan.cluster import tile_starts, ulysses_split


def _tile_starts(degree: int, world_size: int, gpus_per_node: int | None) -> list[int]:
    return [int(x) for x in tile_starts(degree, world_size, world_size if gpus_per_node is None else gpus_per_node)]


def split_blocks(world_size: int, splits: Iterable[tuple[int, int]], gpus_per_node: int | None = None
                 ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(Ulysses sub-groups, rings) of every ``(ulysses, ring)`` split on every tile of its degree, each
    list in one fixed order (every rank must agree). ``gpus_per_node`` None: one node of ``world_size``.
    Sub-groups are listed for ``ulysses > 1`` only; a ring of stride 1 is the tile itself (the pool reuses it)."""
    subs, rings = [], []
    for ulysses, ring in sorted(set(splits)):
        degree = ulysses * ring
        for start in _tile_starts(degree, world_size, gpus_per_node):
            if ulysses > 1:
                subs.extend(tuple(range(start + i * ulysses, start + (i + 1) * ulysses)) for i in range(ring))
            rings.extend(tuple(start + j + ulysses * t for t in range(ring)) for j in range(ulysses))
    return subs, rings


def ring_blocks(world_size: int, splits: Iterable[tuple[int, int]], gpus_per_node: int | None = None
                ) -> list[tuple[int, ...]]:
    """Every ring (global ranks, in ring order) of every ``(ulysses, ring)`` split, in one fixed order."""
    return split_blocks(world_size, splits, gpus_per_node)[1]


def pool_splits(degrees: tuple[int, ...], splits: Iterable[tuple[int, int]] | None,
                ulysses_limit: int | None, heads: int | None = None) -> tuple[tuple[int, int], ...]:
    """The pool's (ulysses, ring) pairs, each of a pooled degree: those given, plus those derived from
    the model's ``heads`` (``ulysses_split``: Ulysses part ``gcd(d, heads)``, the planner's rule) or
    from a power-of-two ``ulysses_limit`` (every degree above it splits ``(limit, d/limit)``)."""
    if ulysses_limit is not None:
        if isinstance(ulysses_limit, bool) or not isinstance(ulysses_limit, int) or ulysses_limit < 1 \
                or ulysses_limit & (ulysses_limit - 1):
            raise PlanError(f"ulysses_limit must be a power of two >= 1, got {ulysses_limit!r}")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise PlanError(f"heads must be a whole number >= 1, got {heads!r}")
    pairs = list(splits or ())
    if ulysses_limit is not None:
        pairs += [(ulysses_limit, d // ulysses_limit) for d in degrees if d > ulysses_limit]
    if heads is not None:
        pairs += [ulysses_split(d, heads) for d in degrees]
    out = set()
    for pair in pairs:
        try:
            u, r = (integer(x, "a split's degree", PlanError, minimum=None) for x in pair)   # 1.5 is not 1
        except (TypeError, ValueError):
            raise PlanError(f"a split is a (ulysses, ring) pair of ints, got {pair!r}") from None
        if u < 1 or r < 1:
            raise PlanError(f"split {u} x {r}: Ulysses and ring degrees must be >= 1")
        if u * r not in degrees:
            raise PlanError(f"split {u} x {r} is a group of {u * r} GPUs, not a pooled degree {list(degrees)}")
        if r > 1:
            out.add((u, r))
    return tuple(sorted(out))


def place(rank: int, ranks: tuple[int, ...], ulysses: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """This rank's Ulysses sub-group ranks, its ring's ranks, and its index on that ring."""
    local = ranks.index(rank)
    ring_index, j = divmod(local, ulysses)
    ulysses_ranks = ranks[ring_index * ulysses:(ring_index + 1) * ulysses]
    ring_ranks = ranks[j::ulysses]
    return ulysses_ranks, ring_ranks, ring_index


class Pending:
    """A tensor whose transfer is in flight; ``wait()`` returns it once it has arrived."""

    def __init__(self, tensor: torch.Tensor, works: list, sent: torch.Tensor) -> None:
        self._tensor, self._works, self._sent = tensor, works, sent   # keep the sent buffer alive until done

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None
        return self._tensor


@dataclass(frozen=True)
class RingComm:
    """One rank's place on a ring: its group, the ring's global ranks and its index among them."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def hop(self, x: torch.Tensor, tag: int = 0) -> Pending:
        """Start sending ``x`` to the next rank and receiving the previous rank's ``x``-shaped tensor."""
        x = x.contiguous()
        recv = torch.empty_like(x)
        nxt, prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, self.group, tag),
                                        dist.P2POp(dist.irecv, recv, prev, self.group, tag)])
        return Pending(recv, works, x)
