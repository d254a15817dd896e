"""Megatron-Core's dynamic context-parallel scheduling rule, as a peer baseline in our simulator.

Megatron-LM's dynamic (hybrid) context parallelism splits the GPUs of each step into CP groups whose
size follows each sequence's length. Its rule, written here from the published description:

1. group size of a sequence: ``max(1, next power of two of ceil(length / max_seqlen_per_rank))``;
2. balance by Megatron's own estimate ``length**2 / group_size`` per GPU of the group (it ignores the
   linear and communication terms on purpose);
3. longest first, each sequence goes to the least-loaded existing group of its size, or opens a new
   group on free GPUs when that is less loaded; a new group starts at estimate 0, so it opens
   whenever enough GPUs are free, and existing groups are joined only when they are not;
4. a micro-batch closes when the spread between the most and least loaded GPU is within 5% of the
   most loaded, or when no remaining sequence fits;
5. GPUs left empty at the close are used by doubling the smallest groups (their sequences' estimate
   halves).

Adaptations to our execution model (micro-batches of concurrent groups, each group running its
sequences one after another, every plan placed, validated and timed by the planner like any other):

- *Micro-batches.* Megatron's GPU domain of one iteration is our ``num_gpus`` per micro-batch; its
  per-iteration sample groups are our micro-batches, run one after another. ``num_gpus`` need not be a
  power of two (48 = 6 nodes of 8): groups are powers of two whose sizes sum to at most ``num_gpus``.
- *Memory.* A group of degree ``d`` holds at most ``costs.capacity[k]`` tokens: a sequence joins the
  least-loaded group of its size *that has room for it*; if none has room and no new group fits in the
  free GPUs, the sequence does not fit this micro-batch.
- *Group size clamped to what exists.* The rule's size is raised to the smallest degree whose group
  holds the sequence alone (only matters when ``max_seqlen_per_rank`` exceeds one GPU's capacity) and
  lowered to the largest degree in ``costs.degrees`` that is at most ``num_gpus`` (only matters when
  ``max_seqlen_per_rank`` is below one GPU's capacity). A sequence no such group can hold raises
  ``DynamicCPInfeasible``. With the default ``max_seqlen_per_rank`` (one GPU's token capacity) the
  rule's size is exactly the memory-minimal degree, so neither clamp acts.
- *A sequence that does not fit is deferred, not a stop.* Scanning longest first, a sequence whose
  size exceeds the free GPUs (and whose size's groups have no room) is left for a later micro-batch
  and the scan goes on with shorter ones; the micro-batch closes when none of the remaining fits
  (Megatron's "no remaining sequence fits"). Deferred sequences keep their longest-first order.
- *Idle GPUs count.* Free GPUs have estimate 0 in the 5% test, so a micro-batch with unused GPUs
  closes only when nothing more fits; then doubling fills them.
- *Doubling stays on the degree ladder.* The smallest group (ties: the earliest opened) is doubled
  while the free GPUs are at least its size and twice its size is a degree of ``costs.degrees``; a
  group at the largest degree is not doubled, so with a non-power-of-two ``num_gpus`` a few GPUs can
  stay idle.
- *Exact arithmetic.* Estimates are kept as integers (``sum(length**2) * (D / d)`` with ``D`` the
  largest degree) so ties and the 5% test are exact; ties break by sequence index (placement order)
  and by group opening order (choice of group).

Cost: O(n log n) for n sequences plus O(classes + groups) per micro-batch (heaps, and a jump over the
sequences of a size class that cannot fit, so no scan of the whole batch per sequence).
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from .costs import DegreeCosts
from .schedule import GroupAssignment, Schedule
from .search import Infeasible

BALANCE_TOLERANCE = 0.05   # Megatron closes a micro-batch when max - min <= 5% of max


class DynamicCPInfeasible(Infeasible):
    """A sequence is longer than the largest group the cluster offers can hold."""


def megatron_group_size(length: int, max_seqlen_per_rank: float) -> int:
    """Megatron's rule: ``max(1, next power of two of ceil(length / max_seqlen_per_rank))``."""
    need = max(1, math.ceil(length / max_seqlen_per_rank))
    return 1 << (need - 1).bit_length()


def group_degrees(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int,
                  max_seqlen_per_rank: float | None = None) -> np.ndarray:
    """Index into ``costs.degrees`` of each sequence's group size: the rule, clamped to what exists.

    Raised to the smallest degree that holds the sequence alone, lowered to the largest degree that
    is at most ``num_gpus``; ``DynamicCPInfeasible`` when even that degree cannot hold it.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    per_rank = default_max_seqlen(costs) if max_seqlen_per_rank is None else float(max_seqlen_per_rank)
    if not per_rank > 0 or not math.isfinite(per_rank):
        raise ValueError(f"max_seqlen_per_rank must be a finite number > 0, got {max_seqlen_per_rank!r}")
    usable = [k for k, d in enumerate(costs.degrees) if d <= num_gpus]
    if not usable:
        raise DynamicCPInfeasible(f"no SP degree of {costs.degrees} fits {num_gpus} GPUs")
    top = usable[-1]
    degrees = np.asarray(costs.degrees[:top + 1], dtype=np.int64)
    capacity = np.asarray(costs.capacity[:top + 1], dtype=np.float64)
    # the smallest degree >= ceil(length / per_rank) is the smallest one >= its next power of two,
    # as degrees are powers of two; beyond the largest degree the rule is clamped to it
    need = np.maximum(1.0, np.ceil(lengths / per_rank))
    by_rule = np.minimum(np.searchsorted(degrees, need, side="left"), top)
    fits = lengths[:, None] <= capacity[None, :]
    if not fits[:, top].all():
        i = int(np.flatnonzero(~fits[:, top])[0])
        raise DynamicCPInfeasible(
            f"sequence {i} has {int(lengths[i])} tokens, more than the largest group can hold: "
            f"{int(degrees[top])} GPUs hold {capacity[top]:.0f} tokens (num_gpus={num_gpus})")
    by_memory = fits.argmax(axis=1)
    out = np.maximum(by_rule, by_memory)
    # capacities need not be monotone in a hand-made DegreeCosts: move up to the next one that fits
    for i in np.flatnonzero(~fits[np.arange(len(lengths)), out]):
        out[i] = next(k for k in range(out[i], top + 1) if fits[i, k])
    return out.astype(np.int64)


def default_max_seqlen(costs: DegreeCosts) -> float:
    """Tokens one GPU can hold: the capacity of the smallest degree, per GPU."""
    return costs.capacity[0] / costs.degrees[0]


class _SizeClass:
    """The pending sequences of one group size, longest first, with O(~1) 'next unplaced' lookups."""

    def __init__(self, k: int, ids: list[int], lengths: list[int]):
        self.k = k
        self.ids = ids
        self.lengths = lengths
        self.neg_lengths = [-s for s in lengths]   # ascending, for bisect
        self.next_free = list(range(len(ids) + 1))  # union-find: next unplaced position >= i
        self.pending = len(ids)

    def find(self, i: int) -> int:
        nxt = self.next_free
        while nxt[i] != i:
            nxt[i] = nxt[nxt[i]]
            i = nxt[i]
        return i

    def take(self, i: int) -> None:
        self.next_free[i] = i + 1
        self.pending -= 1

    def first_at_most(self, start: int, tokens: float) -> int:
        """First unplaced position >= ``start`` whose length is at most ``tokens``."""
        return self.find(max(start, bisect.bisect_left(self.neg_lengths, -tokens)))


@dataclass
class _MicroBatch:
    """Groups being filled: degree, members, tokens and the integer load estimate of each."""

    free: int          # GPUs not in any group yet
    top_degree: int
    degree: list[int] = field(default_factory=list)
    members: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sum_sq: list[int] = field(default_factory=list)
    load: list[int] = field(default_factory=list)    # sum_sq * (top_degree // degree): exact per-GPU estimate
    max_load: int = 0
    by_load: list[tuple[int, int]] = field(default_factory=list)   # lazy min-heap over all groups

    def open(self, degree: int) -> int:
        self.free -= degree
        self.degree.append(degree)
        self.members.append([])
        self.tokens.append(0)
        self.sum_sq.append(0)
        self.load.append(0)
        return len(self.degree) - 1

    def add(self, g: int, seq: int, length: int) -> None:
        self.members[g].append(seq)
        self.tokens[g] += length
        self.sum_sq[g] += length * length
        self.load[g] = self.sum_sq[g] * (self.top_degree // self.degree[g])
        self.max_load = max(self.max_load, self.load[g])
        heapq.heappush(self.by_load, (self.load[g], g))

    def balanced(self, tolerance: tuple[int, int]) -> bool:
        """Megatron's stop, exactly: ``max - min <= tolerance * max`` over every GPU.

        Idle GPUs carry estimate 0, so a micro-batch with free GPUs is never balanced.
        """
        if self.free > 0:
            return False
        while self.by_load[0][0] != self.load[self.by_load[0][1]]:
            heapq.heappop(self.by_load)   # stale: that group's load has grown since
        num, den = tolerance
        return den * (self.max_load - self.by_load[0][0]) <= num * self.max_load

    def fill_idle(self, degrees: tuple[int, ...]) -> None:
        """Double the smallest group (earliest opened first) while the free GPUs cover its size."""
        ladder = set(degrees)
        heap = [(d, g) for g, d in enumerate(self.degree)]
        heapq.heapify(heap)
        while heap:
            d, g = heap[0]
            if self.free < d or 2 * d not in ladder:
                break   # every other group is at least as large
            self.free -= d
            self.degree[g] = 2 * d
            heapq.heapreplace(heap, (2 * d, g))

    def groups(self) -> tuple[GroupAssignment, ...]:
        return tuple(GroupAssignment(d, np.sort(np.asarray(m, dtype=np.int64)))
                     for d, m in zip(self.degree, self.members))


def dynamic_cp(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, *,
               max_seqlen_per_rank: float | None = None,
               tolerance: float = BALANCE_TOLERANCE) -> Schedule:
    """Plan a batch with Megatron-Core's dynamic CP rule (see the module docstring for adaptations).

    ``max_seqlen_per_rank`` defaults to one GPU's token capacity; ``tolerance`` is the 5% stop.
    Deterministic: ties break by sequence index and by group opening order.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if len(lengths) == 0:
        return Schedule(())
    if lengths.min() < 1:
        raise ValueError(f"lengths must be >= 1, got {int(lengths.min())} at {int(lengths.argmin())}")
    size = group_degrees(lengths, costs, num_gpus, max_seqlen_per_rank)
    degrees = tuple(d for d in costs.degrees if d <= num_gpus)
    capacity = costs.capacity
    order = np.lexsort((np.arange(len(lengths)), -lengths))   # longest first, ties by index
    classes = []
    for k in range(len(degrees)):
        ids = order[size[order] == k]
        if len(ids):
            classes.append(_SizeClass(k, ids.tolist(), lengths[ids].tolist()))
    # exact 5% test in integers: max - min <= tol * max  <=>  den*(max - min) <= num*max
    frac = float(tolerance).as_integer_ratio()

    micro_batches: list[tuple[GroupAssignment, ...]] = []
    while classes:
        mb = _MicroBatch(num_gpus, degrees[-1])
        open_groups: dict[int, list[tuple[int, int]]] = {c.k: [] for c in classes}   # (load, group)
        parked: dict[int, list[tuple[float, int]]] = {c.k: [] for c in classes}      # (-room, group)
        frontier = []   # (-length, seq id, class, position): the next candidate of every class
        for c in classes:
            p = c.find(0)
            if p < len(c.ids):
                frontier.append((-c.lengths[p], c.ids[p], c.k, p, c))
        heapq.heapify(frontier)
        while frontier:
            _, seq, k, p, c = heapq.heappop(frontier)
            s, d = c.lengths[p], degrees[k]
            g = _choose_group(mb, d, s, capacity[k], open_groups[k], parked[k])
            if g is None:
                # Neither a new group nor room in one: skip to the first shorter sequence of this size
                # that the roomiest group could take (rooms and free GPUs only shrink from here on).
                room = -parked[k][0][0] if parked[k] else -1.0
                q = c.first_at_most(p + 1, room)
                if q < len(c.ids):
                    heapq.heappush(frontier, (-c.lengths[q], c.ids[q], k, q, c))
                continue
            mb.add(g, seq, s)
            heapq.heappush(open_groups[k], (mb.load[g], g))
            c.take(p)
            q = c.find(p + 1)
            if q < len(c.ids):
                heapq.heappush(frontier, (-c.lengths[q], c.ids[q], k, q, c))
            if mb.balanced(frac):
                break
        mb.fill_idle(degrees)
        micro_batches.append(mb.groups())
        classes = [c for c in classes if c.pending]
    return Schedule(tuple(micro_batches))


def _choose_group(mb: _MicroBatch, degree: int, length: int, capacity: float,
                  open_heap: list[tuple[int, int]], parked: list[tuple[float, int]]) -> int | None:
    """A new group when the free GPUs allow, else the least-loaded group of this size with room."""
    if mb.free >= degree:
        return mb.open(degree)
    # groups parked for lack of room come back once the sequences get short enough for them
    while parked and -parked[0][0] >= length:
        _, g = heapq.heappop(parked)
        heapq.heappush(open_heap, (mb.load[g], g))
    while open_heap:
        _, g = heapq.heappop(open_heap)
        room = capacity - mb.tokens[g]
        if room >= length:
            return g
        heapq.heappush(parked, (-room, g))
    return None
