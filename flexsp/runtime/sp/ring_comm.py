"""Point-to-point for the ring axis: which ranks form rings, and one non-blocking hop around a ring.

A ``ulysses x ring`` group on the aligned block ``[k*d, (k+1)*d)`` has ``ring`` Ulysses sub-groups of
``ulysses`` consecutive ranks (aligned blocks of degree ``ulysses``) and ``ulysses`` rings of stride
``ulysses``: ``{k*d + j + ulysses*t : t < ring}``. Consecutive ranks share the all-to-all - on a real
machine the node's fast links - and the ring's point-to-point crosses the slower ones.

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


def ring_blocks(world_size: int, splits: Iterable[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Every ring (global ranks, in ring order) of every ``(ulysses, ring)`` split, in one fixed order."""
    rings = []
    for ulysses, ring in sorted(set(splits)):
        degree = ulysses * ring
        for block in range(world_size // degree):
            for j in range(ulysses):
                rings.append(tuple(block * degree + j + ulysses * t for t in range(ring)))
    return rings


def pool_splits(degrees: tuple[int, ...], splits: Iterable[tuple[int, int]] | None,
                ulysses_limit: int | None) -> tuple[tuple[int, int], ...]:
    """The pool's (ulysses, ring) pairs: given, or derived from the Ulysses limit; each inside ``degrees``."""
    if ulysses_limit is not None:
        if isinstance(ulysses_limit, bool) or not isinstance(ulysses_limit, int) or ulysses_limit < 1 \
                or ulysses_limit & (ulysses_limit - 1):
            raise PlanError(f"ulysses_limit must be a power of two >= 1, got {ulysses_limit!r}")
    pairs = list(splits or ())
    if ulysses_limit is not None:
        pairs += [(ulysses_limit, d // ulysses_limit) for d in degrees if d > ulysses_limit]
    out = set()
    for pair in pairs:
        try:
            u, r = (int(x) for x in pair)
        except (TypeError, ValueError):
            raise PlanError(f"a split is a (ulysses, ring) pair of ints, got {pair!r}") from None
        if u < 1 or r < 1 or u & (u - 1) or r & (r - 1):
            raise PlanError(f"split {u} x {r}: Ulysses and ring degrees must be powers of two")
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
