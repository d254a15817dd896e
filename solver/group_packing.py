"""Group bin-packing of one micro-batch: pick SP degrees and fill groups, by bisection on the makespan.

The problem works on bucketed lengths (a few distinct lengths with counts), and identical groups
are kept as one *group class* with a multiplicity, so a packing costs O(buckets x classes) whatever
the number of sequences or GPUs (a class splits only when a bucket fills it partially, so there are
at most a few per bucket). For a target makespan ``T`` each bucket goes to the degree that needs the
fewest GPUs for it within ``T`` and the memory limit; buckets are placed longest first, topping up
groups that already have room (fullest first, i.e. best fit) before opening new ones. ``T`` is
bisected between a lower bound and the memory-only packing; the smallest ``T`` whose packing needs
at most ``N`` GPUs wins. With degrees whose tiles do not nest (``DegreeCosts.placeable`` given), a
packing must also place: one whose group counts per degree get no ranks counts as not fitting (the
check is cached by those counts, a handful of numbers, so it costs per distinct degree mix).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from .types import DegreeCosts


@dataclass
class BinPacking:
    """Groups on bucketed lengths, as classes of identical groups: degree index, bucket counts
    and multiplicity per class (``mult`` None: one group per row)."""

    degree_idx: np.ndarray        # [C] index into DegreeCosts.degrees
    counts: np.ndarray            # [C, B] sequences of each bucket in each group of the class
    makespan: float               # bucketed estimate of the slowest group, beta1 included
    mult: np.ndarray | None = None  # [C] groups in each class

    def multiplicity(self) -> np.ndarray:
        return np.ones(len(self.degree_idx), dtype=np.int64) if self.mult is None else self.mult

    def expanded(self) -> "BinPacking":
        """One row per group."""
        if self.mult is None:
            return self
        return BinPacking(np.repeat(self.degree_idx, self.mult), np.repeat(self.counts, self.mult, axis=0), self.makespan)

    def total_counts(self) -> np.ndarray:
        return (self.counts * self.multiplicity()[:, None]).sum(axis=0)


@dataclass(slots=True)
class _GroupClass:
    k: int                   # degree index
    mult: int                # how many identical groups
    time: float              # seconds of sequences in each (no beta1)
    tokens: float
    items: list[tuple[int, int]]  # (bucket, count) in each group
    limit: float = 0.0            # time budget the class was opened under (stretched groups: more)

    def add(self, bucket: int, count: int, seq_time: float, length: float) -> None:
        self.time += count * seq_time
        self.tokens += count * length
        self.items.append((bucket, count))

    def split(self, mult: int) -> "_GroupClass":
        """Detach ``mult`` of the groups as a class of their own."""
        self.mult -= mult
        return _GroupClass(self.k, mult, self.time, self.tokens, list(self.items), self.limit)


_time = attrgetter("time")


class MicroBatchPacker:
    """Packs bucket counts of one micro-batch onto at most ``num_gpus`` GPUs."""

    def __init__(self, bucket_lengths: np.ndarray, costs: DegreeCosts, num_gpus: int,
                 bucket_times: np.ndarray | None = None):
        """``bucket_times[b, k]``: seconds a bucket-``b`` sequence takes at degree ``k``; by default
        the time of the bucket's upper length. Memory always uses the upper length (never overflows)."""
        self.lengths = np.asarray(bucket_lengths, dtype=np.float64)
        self.costs = costs
        self.num_gpus = num_gpus
        degrees = np.asarray(costs.degrees)
        upper_times = costs.times(self.lengths)                   # [B, D], inf when it cannot fit
        self.times = upper_times if bucket_times is None else np.where(np.isfinite(upper_times), bucket_times, np.inf)
        self.area = self.times * degrees[None, :]                 # GPU-seconds per sequence
        self.min_area = self.area.min(axis=1)
        self.min_time = upper_times.min(axis=1)                  # the longest member sets the critical path
        self.order = [int(b) for b in np.argsort(-self.lengths, kind="stable")]  # longest first
        # plain-Python copies: the packing loop touches a handful of numbers at a time
        self._degrees = [int(d) for d in costs.degrees]
        # GPUs a group is charged when choosing its degree: its degree, or where tiles do not nest the
        # share of the cluster one tile takes (N / tiles: a 5 in a node of 8 leaves 3 GPUs only small
        # groups can use, so it is charged 8); the budget itself still counts degrees, plus placement
        charge = (self._degrees if costs.placeable is None or not costs.tiles
                  else [num_gpus / max(1, int(t)) for t in costs.tiles])
        self._capacity = [float(c) for c in costs.capacity]
        self._lengths = self.lengths.tolist()
        self._times = self.times.tolist()
        # per bucket, where it runs: (degree index, most of its sequences one group of that degree holds,
        # seconds of one there, GPUs charged), as the packing loop reads them
        self._choices = [[(k, math.floor(self._capacity[k] / length), t, charge[k])
                          for k, t in enumerate(row) if math.isfinite(t)]
                         for row, length in zip(self._times, self._lengths)]
        self._stretched = [t * (1 + 1e-9) for t in self.min_time.tolist()]   # a lone sequence's budget (``stretch``)
        self._cache: dict[bytes, BinPacking | None] = {}
        self._placeable: dict[bytes, bool] = {}

    # --- bounds -------------------------------------------------------------------------------
    def lower_bound(self, counts: np.ndarray) -> float:
        """No packing beats perfect spreading of the cheapest area, nor the slowest sequence alone."""
        present = counts > 0
        if not present.any():
            return 0.0
        spread = float((counts * self.min_area)[present].sum()) / self.num_gpus
        return max(spread, float(self.min_time[present].max())) + self.costs.beta1

    # --- one target -------------------------------------------------------------------------
    def pack(self, counts: np.ndarray, makespan: float, max_gpus: float | None = None,
             stretch: bool = False) -> BinPacking | None:
        """Groups whose bucketed time stays within ``makespan``, or None if they need more than
        ``max_gpus`` GPUs (default N; pass ``math.inf`` to pack a whole batch into any number).

        ``stretch``: a sequence slower than ``makespan`` even alone at its best degree gets a group
        of its own time instead of failing (used to pack a whole batch, where such a group will
        set the pace of its own micro-batch)."""
        classes = self._pack_classes(counts, makespan, max_gpus, stretch)
        return None if classes is None else self._expand(classes, len(counts))

    def _pack_classes(self, counts: np.ndarray, makespan: float, max_gpus: float | None = None,
                      stretch: bool = False) -> list[_GroupClass] | None:
        """``pack`` as group classes, before they become arrays (a bisection expands only its last)."""
        max_gpus = self.num_gpus if max_gpus is None else max_gpus
        target = makespan - self.costs.beta1
        if target <= 0:
            return None
        degrees, capacity, choices, stretched = self._degrees, self._capacity, self._choices, self._stretched
        counts = counts.tolist() if isinstance(counts, np.ndarray) else [int(c) for c in counts]
        classes: list[_GroupClass] = []
        gpus = 0
        for b in self.order:
            left = counts[b]
            if left == 0:
                continue
            length, t_b = self._lengths[b], self._times[b]
            budget = target
            if stretch and stretched[b] > target:
                budget = stretched[b]
            # the degree that needs the fewest GPUs for the whole bucket (ties -> smallest degree)
            k_new, best_gpus, per_new = -1, math.inf, 0
            for k, held, t, ch in choices[b]:   # floor(min(x, y)) = min(floor(x), floor(y)); no int(inf)
                x = budget / t
                per = held if x >= held else int(x)
                if per > 0:
                    needed = -(-left // per) * ch
                    if needed < best_gpus:
                        k_new, best_gpus, per_new = k, needed, per
            if k_new < 0:
                return None                   # this bucket alone exceeds the budget everywhere
            # classes that may take this bucket, longest first (ties keep their order: a stable sort)
            if len(classes) < 2:
                open_classes = [c for c in classes if c.k >= k_new]
            else:
                open_classes = sorted(classes if k_new == 0 else [c for c in classes if c.k >= k_new],
                                      key=_time, reverse=True)
            for cls in open_classes:
                t = t_b[cls.k]
                by_time = ((budget if budget > cls.limit else cls.limit) - cls.time) / t
                by_memory = (capacity[cls.k] - cls.tokens) / length
                fit = by_time if by_time < by_memory else by_memory
                if fit < 1:
                    continue
                fit = int(fit)                # floor: fit >= 1
                if cls.mult * fit > left:     # only part of the class takes this bucket
                    full, rest = divmod(left, fit)
                    untouched = cls.mult - full - (1 if rest else 0)
                    if untouched:
                        classes.append(cls.split(untouched))
                    if rest:
                        partial = cls.split(1)
                        partial.add(b, rest, t, length)
                        classes.append(partial)
                    if cls.mult:              # the remaining `full` groups take `fit` each
                        cls.add(b, fit, t, length)
                    left = 0
                else:
                    cls.add(b, fit, t, length)
                    left -= cls.mult * fit
                if left <= 0:
                    break
            if left > 0:
                gpus += -(-left // per_new) * degrees[k_new]
                if gpus > max_gpus:
                    return None
                full, rest = divmod(left, per_new)
                for mult, count in ((full, per_new), (1 if rest else 0, rest)):
                    if mult:
                        classes.append(_GroupClass(k_new, mult, count * t_b[k_new], count * length, [(b, count)], budget))
        classes = [c for c in classes if c.mult]
        if self.costs.placeable is not None and max_gpus <= self.num_gpus and not self._places(classes):
            return None
        return classes

    def _places(self, classes: list[_GroupClass]) -> bool:
        """Whether groups of these classes get ranks in one micro-batch (``DegreeCosts.placeable``), cached."""
        per_degree = np.zeros(len(self._degrees), dtype=np.int64)
        for c in classes:
            per_degree[c.k] += c.mult
        key = per_degree.tobytes()
        if key not in self._placeable:
            self._placeable[key] = self.costs.places(per_degree)
        return self._placeable[key]

    def _expand(self, classes: list[_GroupClass], num_buckets: int) -> BinPacking:
        mult = np.array([c.mult for c in classes], dtype=np.int64)
        rows = []
        for c in classes:                 # a class takes each bucket at most once
            row = [0] * num_buckets
            for b, q in c.items:
                row[b] += q
            rows.append(row)
        per_class = np.array(rows, dtype=np.int64).reshape(len(classes), num_buckets)
        return BinPacking(degree_idx=np.array([c.k for c in classes], dtype=np.int64), counts=per_class,
                          makespan=self._makespan(classes), mult=mult)

    def _makespan(self, classes: list[_GroupClass]) -> float:
        """The slowest group's bucketed time, beta1 included."""
        return max(c.time for c in classes) + self.costs.beta1

    def group_times(self, packing: BinPacking) -> np.ndarray:
        """Bucketed seconds of each group (of each class: no beta1)."""
        per_seq = self.times[:, packing.degree_idx].T
        return (packing.counts * np.where(packing.counts > 0, per_seq, 0.0)).sum(axis=1)

    # --- search -------------------------------------------------------------------------------
    def pack_memory(self, counts: np.ndarray) -> BinPacking | None:
        """The packing at an unbounded makespan (memory alone): one pass, cached; the upper end of
        ``solve``'s bisection, and a valid packing when there is no time to bisect."""
        key = b"m" + np.asarray(counts, dtype=np.int64).tobytes()
        if key not in self._cache:
            self._cache[key] = self.pack(counts, math.inf)
        return self._cache[key]

    def solve(self, counts: np.ndarray, rel_tol: float = 2e-3, max_iter: int = 40,
              below: float = math.inf) -> BinPacking | None:
        """Bisect the makespan; None when no makespan fits the micro-batch into N GPUs (memory).

        ``below``: the makespan of a packing of these counts the caller already has. The bisection
        starts there instead of at the memory-only packing (fewer steps), and None means none was
        found below it (that answer is not cached: without the hint a packing exists).

        Results are cached by ``counts``: the local search asks for the same micro-batch often.
        """
        key = np.asarray(counts, dtype=np.int64).tobytes()
        if key not in self._cache:
            got = self._solve(counts, rel_tol, max_iter, below)
            if got is None and below < math.inf:
                return None
            self._cache[key] = got
        return self._cache[key]

    def _solve(self, counts: np.ndarray, rel_tol: float, max_iter: int, below: float = math.inf) -> BinPacking | None:
        lo = self.lower_bound(counts)
        if lo == 0.0:
            return None
        if below < math.inf:
            # one packing at ``below`` first: most callers' packings are already as good as the packer
            # finds, and then this one step answers (None) instead of a whole bisection
            best, found = None, self._pack_classes(counts, below)
            if found is None:
                return None
            hi = min(below, self._makespan(found))
        else:
            best, found = self.pack_memory(counts), None     # memory alone decides whether any makespan works
            if best is None:
                return None
            hi = best.makespan
        for _ in range(max_iter):
            if hi - lo <= rel_tol * hi:
                break
            mid = 0.5 * (lo + hi)
            got = self._pack_classes(counts, mid)
            if got is None:
                lo = mid
            else:
                found, hi = got, min(mid, self._makespan(got))
        return best if found is None else self._expand(found, len(counts))
