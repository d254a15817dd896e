"""Megatron-Core's dynamic context-parallel scheduler, as a peer baseline in our simulator.

This follows ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py`` of
NVIDIA/Megatron-LM, the ``get_groups_and_subsamples`` / ``next_hdp_group`` loop) step by step, so
that a speedup quoted over ``dynamic-cp`` is a speedup over Megatron's own rule. The tests compare
it, plan for plan, with plans the upstream class produced (``tests/fixtures/megatron_dynamic_cp``).

Upstream, per global batch:

1. group size of a sequence: ``max(1, 2**ceil(log2(length / max_seqlen_per_rank)))``; its estimate
   per GPU ``length**2 / size`` (linear and communication terms ignored on purpose);
2. the sequences are sorted longest first once; each iteration (one of our micro-batches) splits
   the pending list into work-balanced buckets (``make_buckets_equal``: as many as there are sizes
   among them, a bucket closes when it would exceed 1.1x the mean work or when the sequences left
   are needed for the buckets still to come);
3. it looks only at each bucket's *first* pending sequence, buckets in order, and places the first
   that can go: on a new group when enough GPUs are free (a new group has load 0, so it always
   wins), else on the least-loaded existing group of its size; when no bucket's first sequence can
   go, the iteration closes;
4. the 5% stop (``max - min <= 0.05 * max`` over all GPUs, idle ones at 0) is tested only once a
   sequence of a smaller size than the iteration's first one has been placed, and only while
   sequences remain;
5. ``trim_overload``: while the spread exceeds 5% and no GPU is idle, the last sequence added to the
   most loaded group (the first such in rank order) is taken off and re-queued at the *end* of the
   pending list, as long as that narrows the spread and the group keeps one sequence;
6. ``fill_empty_gpus``: idle GPUs are used by doubling the smallest group (the first in rank order)
   until none is idle.

Departures, each needed by our execution model (micro-batches of concurrent groups, each group
running its sequences *packed together*), each measured in ``experiments/dynamic_cp_benchmark.py``:

- *A group never holds more tokens than its memory* (``costs.capacity``): an existing group is a
  candidate for a sequence only if it has room for it, both in the scan of step 3 and in the choice
  of the least-loaded group. Upstream runs a group's sequences one at a time, so it has no such cap;
  with the default ``max_seqlen_per_rank`` (one GPU's token capacity) the cap is ``size * P``,
  exactly what the fixture's upstream runs used. The token count shrinks when step 5 trims.
- *Group size clamped to what exists*: raised to the smallest degree whose group holds the sequence
  alone (only when ``max_seqlen_per_rank`` exceeds one GPU's capacity: upstream would overflow
  memory) and lowered to the largest degree in ``costs.degrees`` that is at most ``num_gpus`` (only
  when ``max_seqlen_per_rank`` is so small that the rule asks for more GPUs than exist: upstream
  never places such a sequence and stops on an assertion). A sequence no group can hold raises
  ``DynamicCPInfeasible``. With the default ``max_seqlen_per_rank`` neither clamp acts.
- *Doubling stays on the degree ladder*: step 6 doubles only while twice the size is in
  ``costs.degrees`` and the idle GPUs cover it, so with a ``num_gpus`` that is not a power of two a
  few GPUs can stay idle (upstream would form a group of ``num_gpus`` GPUs, which our runtime's
  power-of-two groups do not offer). Identical for a power-of-two ``num_gpus``.
- *Exact arithmetic* for the estimates, the 5% test and the trim (integers ``length**2 * L / size``
  with ``L`` the lcm of the degrees; upstream's floats are exact here too, so ties and tests agree).
  Bucket boundaries are computed in floats, in upstream's order.

``lookahead="all"`` instead scans every pending sequence longest first and defers one that does not
fit (this module's earlier adaptation); it packs more per micro-batch but is not Megatron's rule, and
is kept only so the benchmark can measure what that departure would change.

Cost: no step touches every pending sequence per micro-batch. The pending list lives in ``_Pending``
(slots in upstream's order, a linked list of the live ones, per-block counts and work sums), so the
buckets of an iteration are found with a few block-level searches, O(n / B + B) in numpy for blocks of
B slots, and each placed sequence costs O(log groups) (heaps; a bucket whose first sequence cannot go
stays blocked for the rest of the iteration, as free GPUs and room only shrink until the trim), plus
O(groups) per trimmed sequence. Bucket boundaries compare exact integer work sums with upstream's
float threshold: identical to upstream's float running sums whenever those are exact (work sums below
2**53 / L), as in every fixture.

Deadline: past ``deadline`` (``time.perf_counter()`` seconds) the sequences still pending are packed by
a linear next-fit of the same group sizes (``_finish_fast``), so the plan always arrives in time.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from .types import DegreeCosts, GroupAssignment, Infeasible, Schedule

BALANCE_TOLERANCE = 0.05   # Megatron's delta: balanced when max - min <= 5% of max
BUCKET_SLACK = 1.1         # make_buckets_equal closes a bucket above 1.1x the mean work
LOOKAHEADS = ("buckets", "all")


class DynamicCPInfeasible(Infeasible):
    """A sequence is longer than the largest group the cluster offers can hold."""


def megatron_group_size(length: int, max_seqlen_per_rank: float) -> int:
    """Megatron's rule: ``max(1, 2**ceil(log2(length / max_seqlen_per_rank)))``."""
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


@dataclass(frozen=True)
class _Batch:
    """Per-sequence facts the iterations share (plain Python lists: the loops are scalar)."""

    length: list[int]
    size: list[int]       # index into degrees
    degrees: tuple[int, ...]
    capacity: tuple[float, ...]
    estimate: list[int]   # length**2 * scale // degree: Megatron's per-GPU estimate, times `scale`
    work: list[float]     # the same estimate in upstream's floats, for bucket boundaries
    scale: int = 1        # lcm of the degrees


def make_buckets(pending: list[int], batch: _Batch) -> list[list[int]]:
    """Upstream's ``make_buckets_equal``: consecutive runs of ``pending`` with about equal work. The
    plain scan, kept as the reference ``_Pending.buckets`` (the block search the planner runs) is
    tested against.

    As many buckets as there are sizes among ``pending``, give or take: a bucket closes before a
    sequence that would take it above 1.1x the mean, or when the sequences left are needed for the
    buckets still to open (upstream's test, kept as written).
    """
    k = len({batch.size[i] for i in pending})
    target = sum(batch.work[i] for i in pending) / k
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_work, remaining_k, n = 0.0, k, len(pending)
    for pos, i in enumerate(pending):
        w = batch.work[i]
        if cur and (cur_work + w > target * BUCKET_SLACK or n - pos <= remaining_k - len(buckets)):
            buckets.append(cur)
            cur, cur_work = [], 0.0
            remaining_k -= 1
        cur.append(i)
        cur_work += w
    if cur:
        buckets.append(cur)
    return buckets


class _Iteration:
    """One upstream iteration: the groups of one micro-batch as they are filled, trimmed, doubled."""

    def __init__(self, batch: _Batch, num_gpus: int, tolerance: tuple[int, int]) -> None:
        self.batch, self.free, self.tolerance = batch, num_gpus, tolerance
        self.degree: list[int] = []
        self.members: list[list[int]] = []
        self.tokens: list[int] = []
        self.load: list[int] = []
        self.max_load = 0
        self._by_load: list[tuple[int, int]] = []                          # lazy min-heap, all groups
        n = len(batch.degrees)
        self._open: list[list[tuple[int, int]]] = [[] for _ in range(n)]   # (load, group) per size
        self._full: list[list[tuple[int, int]]] = [[] for _ in range(n)]   # (tokens, group) per size
        self._is_full: list[bool] = []

    # --- placement -------------------------------------------------------------------------------
    def target(self, seq: int) -> int | None:
        """Where upstream puts ``seq``: a new group if the free GPUs allow, else the least-loaded
        group of its size with room (ties: the earliest opened); None if neither exists."""
        k = self.batch.size[seq]
        if self.free >= self.batch.degrees[k]:
            return -1
        s, cap = self.batch.length[seq], self.batch.capacity[k]
        full, heap = self._full[k], self._open[k]
        while full and full[0][0] + s <= cap:   # groups set aside for lack of room, roomy enough now
            _, g = heapq.heappop(full)
            self._is_full[g] = False
            heapq.heappush(heap, (self.load[g], g))
        while heap:
            load, g = heap[0]
            if self._is_full[g] or load != self.load[g]:
                heapq.heappop(heap)   # stale entry
            elif self.tokens[g] + s <= cap:
                return g
            else:
                heapq.heappop(heap)
                self._is_full[g] = True
                heapq.heappush(full, (self.tokens[g], g))
        return None

    def place(self, seq: int, g: int) -> None:
        b = self.batch
        k = b.size[seq]
        if g < 0:
            d = b.degrees[k]
            self.free -= d
            g = len(self.degree)
            self.degree.append(d)
            self.members.append([])
            self.tokens.append(0)
            self.load.append(0)
            self._is_full.append(False)
        self.members[g].append(seq)
        self.tokens[g] += b.length[seq]
        self.load[g] += b.estimate[seq]
        self.max_load = max(self.max_load, self.load[g])
        heapq.heappush(self._by_load, (self.load[g], g))
        heapq.heappush(self._open[k], (self.load[g], g))

    def balanced(self) -> bool:
        """``max - min <= delta * max`` over every GPU; idle GPUs are at 0, so never with some idle."""
        if self.free > 0:
            return False
        heap = self._by_load
        while heap[0][0] != self.load[heap[0][1]]:
            heapq.heappop(heap)
        num, den = self.tolerance
        return den * (self.max_load - heap[0][0]) <= num * self.max_load

    # --- after the loop --------------------------------------------------------------------------
    def trim(self) -> list[int]:
        """Upstream's ``trim_overload``; returns the sequences taken off, in the order taken."""
        num, den = self.tolerance
        load, taken = self.load, []
        while self.free == 0:
            top, low = max(load), min(load)
            if den * (top - low) <= num * top:
                break
            g = load.index(top)   # groups are in rank order: the first rank at the maximum
            if len(self.members[g]) <= 1:
                break
            seq = self.members[g][-1]
            load[g] -= self.batch.estimate[seq]
            if max(load) - min(load) < top - low:
                self.members[g].pop()
                self.tokens[g] -= self.batch.length[seq]
                taken.append(seq)
            else:
                load[g] += self.batch.estimate[seq]
                break
        return taken

    def fill_idle(self) -> None:
        """Upstream's ``fill_empty_gpus``: double the smallest group (the first in rank order) while
        GPUs are idle, within the degree ladder."""
        ladder = set(self.batch.degrees)
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


class _Pending:
    """Upstream's pending list without its O(n) rebuild per micro-batch.

    Slot ``t`` holds sequence ``seq[t]`` in upstream's order (trimmed sequences are appended); a
    doubly linked list joins the live slots; ``weight``/``alive`` per slot and their per-block sums
    answer "where does a run of work exceed x" and "which is the m-th live slot" with numpy searches.
    Work is the exact integer estimate (``_Batch.estimate``).
    """

    BLOCK = 512
    END = -1

    def __init__(self, order: list[int], batch: _Batch) -> None:
        self.batch = batch
        n = len(order)
        cap = max(self.BLOCK, n + n // 4 + 1)
        big = sum(batch.estimate) >= 1 << 62          # beyond int64: Python ints (slow, exact)
        self._dtype = object if big else np.int64
        self.seq = list(order) + [0] * (cap - n)
        self.weight = np.zeros(cap, dtype=self._dtype)
        self.weight[:n] = np.asarray([batch.estimate[i] for i in order], dtype=self._dtype)
        self.alive = np.zeros(cap, dtype=np.int64)
        self.alive[:n] = 1
        self.nxt = list(range(1, n)) + [self.END]
        self.prv = [self.END] + list(range(0, n - 1))
        self.nxt += [self.END] * (cap - n)
        self.prv += [self.END] * (cap - n)
        self.head = 0 if n else self.END
        self.tail = n - 1 if n else self.END
        self.used = n
        self.count = n
        self.total = int(sum(batch.estimate[i] for i in order))
        self.sizes = [0] * len(batch.degrees)
        for i in order:
            self.sizes[batch.size[i]] += 1
        self._blocks()

    def _blocks(self) -> None:
        nb = -(-len(self.seq) // self.BLOCK)
        pad = nb * self.BLOCK - len(self.seq)
        w = np.concatenate([self.weight, np.zeros(pad, dtype=self._dtype)])
        a = np.concatenate([self.alive, np.zeros(pad, dtype=np.int64)])
        self.blk_weight = w.reshape(nb, self.BLOCK).sum(axis=1)
        self.blk_alive = a.reshape(nb, self.BLOCK).sum(axis=1)

    def remove(self, t: int) -> None:
        i = self.seq[t]
        self.count -= 1
        self.total -= self.batch.estimate[i]
        self.sizes[self.batch.size[i]] -= 1
        b = t // self.BLOCK
        self.blk_weight[b] -= self.weight[t]
        self.blk_alive[b] -= 1
        self.weight[t] = 0
        self.alive[t] = 0
        p, q = self.prv[t], self.nxt[t]
        if p == self.END:
            self.head = q
        else:
            self.nxt[p] = q
        if q == self.END:
            self.tail = p
        else:
            self.prv[q] = p

    def append(self, i: int) -> None:
        if self.used == len(self.seq):
            grow = len(self.seq)
            self.seq += [0] * grow
            self.nxt += [self.END] * grow
            self.prv += [self.END] * grow
            self.weight = np.concatenate([self.weight, np.zeros(grow, dtype=self._dtype)])
            self.alive = np.concatenate([self.alive, np.zeros(grow, dtype=np.int64)])
            self._blocks()
        t = self.used
        self.used += 1
        self.seq[t] = i
        e = self.batch.estimate[i]
        self.weight[t] = e
        self.alive[t] = 1
        self.blk_weight[t // self.BLOCK] += e
        self.blk_alive[t // self.BLOCK] += 1
        self.prv[t], self.nxt[t] = self.tail, self.END
        if self.tail == self.END:
            self.head = t
        else:
            self.nxt[self.tail] = t
        self.tail = t
        self.count += 1
        self.total += e
        self.sizes[self.batch.size[i]] += 1

    def _first_over(self, values: np.ndarray, blocks: np.ndarray, t: int, x: int) -> int:
        """The first slot ``u >= t`` where the running sum of ``values`` from ``t`` exceeds ``x``."""
        end = min((t // self.BLOCK + 1) * self.BLOCK, self.used)
        run = np.cumsum(values[t:end])
        if run.size and run[-1] > x:
            return t + int(np.searchsorted(run, x, side="right"))
        x -= int(run[-1]) if run.size else 0
        b0 = t // self.BLOCK + 1
        over = np.cumsum(blocks[b0:])
        j = int(np.searchsorted(over, x, side="right"))
        if j == over.size:
            return self.END
        x -= int(over[j - 1]) if j else 0
        start = (b0 + j) * self.BLOCK
        run = np.cumsum(values[start:min(start + self.BLOCK, self.used)])
        return start + int(np.searchsorted(run, x, side="right"))

    def _live_before(self, t: int) -> int:
        b = t // self.BLOCK
        return int(self.blk_alive[:b].sum()) + int(self.alive[b * self.BLOCK:t].sum())

    def work_cut(self, t: int, x: int) -> int:
        """The first live slot after ``t`` at which the work from ``t`` on exceeds ``x`` (or END)."""
        u = self._first_over(self.weight, self.blk_weight, t, x)
        return self.nxt[t] if u == t else u

    def nth_after(self, t: int, m: int) -> int:
        """The live slot ``m`` places after live slot ``t`` (END past the last)."""
        return self._first_over(self.alive, self.blk_alive, t, m)

    def singletons(self) -> list[tuple[int, int]]:
        """Every live slot as a run of its own, in order."""
        out, t = [], self.head
        while t != self.END:
            out.append((t, self.nxt[t]))
            t = self.nxt[t]
        return out

    def buckets(self) -> list[tuple[int, int]]:
        """Upstream's ``make_buckets_equal`` as (first slot, slot after the last) runs, exactly:
        a bucket closes before the sequence that takes its work above 1.1x the mean, or where the
        sequences left are needed for the buckets still to open."""
        k = sum(1 for c in self.sizes if c)
        scale_work = self.total / self.batch.scale          # upstream's float sum, when exact
        threshold = math.floor(scale_work / k * BUCKET_SLACK * self.batch.scale)
        out, start, rank, n = [], self.head, 0, self.count
        while start != self.END:
            j = len(out)
            cut = self.work_cut(start, threshold)
            count_at = max(rank + 1, n - k + 2 * j)       # upstream: n - pos <= remaining_k - len(buckets)
            if count_at < n:
                by_count = self.nth_after(start, count_at - rank)
                if cut == self.END or by_count < cut:
                    cut = by_count
            out.append((start, cut))
            if cut != self.END:
                rank += self._live_before(cut) - self._live_before(start)
            start = cut
        return out


def _iterate_buckets(pending: _Pending, batch: _Batch, num_gpus: int, tolerance: tuple[int, int],
                     every_sequence: bool = False) -> tuple[GroupAssignment, ...]:
    """One micro-batch of upstream's bucketed rule; updates ``pending`` in place (placed sequences
    leave it, trimmed ones go to its end). ``every_sequence``: each pending sequence is its own bucket
    (``lookahead="all"``, the measured deferral departure)."""
    runs = pending.singletons() if every_sequence else pending.buckets()
    head = [start for start, _ in runs]
    stop = [end for _, end in runs]
    blocked = [False] * len(runs)
    placed: list[int] = []
    it = _Iteration(batch, num_gpus, tolerance)
    remaining, first, first_degree, check = pending.count, 0, None, False
    while True:
        chosen = None
        b = first
        while b < len(runs):
            if not blocked[b] and head[b] != stop[b]:
                g = it.target(pending.seq[head[b]])
                if g is not None:
                    chosen = g
                    break
                blocked[b] = True
            if b == first:
                first += 1
            b += 1
        if chosen is None:
            break
        t = head[b]
        seq = pending.seq[t]
        head[b] = pending.nxt[t]
        placed.append(t)
        it.place(seq, chosen)
        remaining -= 1
        degree = batch.degrees[batch.size[seq]]
        first_degree = degree if first_degree is None else first_degree
        check = check or degree < first_degree
        if check and remaining and it.balanced():
            break
    for t in placed:
        pending.remove(t)
    for seq in it.trim():
        pending.append(seq)
    it.fill_idle()
    return it.groups()


def _finish_fast(order: list[int], batch: _Batch, num_gpus: int) -> list[tuple[GroupAssignment, ...]]:
    """Past the deadline: the rest in order, next-fit into groups of each sequence's size, O(n)."""
    out: list[tuple[GroupAssignment, ...]] = []
    groups: list[tuple[int, list[int]]] = []
    tokens: list[int] = []
    open_by_size: dict[int, int] = {}
    free = num_gpus
    for i in order:
        k = batch.size[i]
        g = open_by_size.get(k)
        if g is not None and tokens[g] + batch.length[i] <= batch.capacity[k]:
            groups[g][1].append(i)
            tokens[g] += batch.length[i]
            continue
        if free < batch.degrees[k]:
            out.append(tuple(GroupAssignment(d, np.sort(np.asarray(m, dtype=np.int64))) for d, m in groups))
            groups, tokens, open_by_size, free = [], [], {}, num_gpus
        free -= batch.degrees[k]
        open_by_size[k] = len(groups)
        groups.append((batch.degrees[k], [i]))
        tokens.append(batch.length[i])
    if groups:
        out.append(tuple(GroupAssignment(d, np.sort(np.asarray(m, dtype=np.int64))) for d, m in groups))
    return out


def dynamic_cp(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, *,
               max_seqlen_per_rank: float | None = None, tolerance: float = BALANCE_TOLERANCE,
               lookahead: str = "buckets", deadline: float | None = None) -> Schedule:
    """Plan a batch with Megatron-Core's ``BalancedCPScheduler`` rule (see the module docstring).

    ``max_seqlen_per_rank`` defaults to one GPU's token capacity; ``tolerance`` is the 5% stop;
    ``lookahead="all"`` measures the deferral departure (not Megatron's rule). ``deadline``
    (``time.perf_counter()`` seconds): past it the rest is packed by a linear next-fit. Deterministic
    when the deadline is not reached.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if lookahead not in LOOKAHEADS:
        raise ValueError(f"lookahead must be one of {LOOKAHEADS}, got {lookahead!r}")
    if len(lengths) == 0:
        return Schedule(())
    if lengths.min() < 1:
        raise ValueError(f"lengths must be >= 1, got {int(lengths.min())} at {int(lengths.argmin())}")
    size = group_degrees(lengths, costs, num_gpus, max_seqlen_per_rank)
    degrees = tuple(d for d in costs.degrees if d <= num_gpus)
    scale = math.lcm(*degrees)
    length = lengths.tolist()
    size_list = size.tolist()
    batch = _Batch(length=length, size=size_list, degrees=degrees, capacity=tuple(costs.capacity[:len(degrees)]),
                   estimate=[s * s * (scale // degrees[k]) for s, k in zip(length, size_list)],
                   work=[s * s / degrees[k] for s, k in zip(length, size_list)], scale=scale)
    frac = float(tolerance).as_integer_ratio()
    # upstream sorts once, longest first (a stable sort: ties keep the batch order)
    order = np.lexsort((np.arange(len(lengths)), -lengths)).tolist()
    micro_batches: list[tuple[GroupAssignment, ...]] = []
    late = lambda: deadline is not None and time.perf_counter() > deadline  # noqa: E731
    pending = _Pending(order, batch)
    while pending.count and not late():
        micro_batches.append(_iterate_buckets(pending, batch, num_gpus, frac, every_sequence=lookahead == "all"))
    order, t = [], pending.head
    while t != _Pending.END:
        order.append(pending.seq[t])
        t = pending.nxt[t]
    micro_batches += _finish_fast(order, batch, num_gpus)
    return Schedule(tuple(micro_batches))
