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
check is cached by those counts, a handful of numbers, so it costs per distinct degree mix). The packing
loop and its bisection run compiled (``kernels.pack_classes``, ``kernels.best_packing``); this class
prepares their arrays, caches their answers and turns them into ``BinPacking``s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
        self.order = np.argsort(-self.lengths, kind="stable")      # longest first
        # GPUs a group is charged when choosing its degree: its degree, or where tiles do not nest the
        # share of the cluster one tile takes (N / tiles: a 5 in a node of 8 leaves 3 GPUs only small
        # groups can use, so it is charged 8); the budget itself still counts degrees, plus placement
        charge = (degrees if costs.placeable is None or not costs.tiles
                  else num_gpus / np.maximum(1, np.asarray(costs.tiles, dtype=np.int64)))
        capacity = np.asarray(costs.capacity, dtype=np.float64)
        # the kernel's view (``kernels.pack_classes``): most sequences of each bucket one group of each
        # degree holds, the charge, a lone sequence's budget (``stretch``)
        held = np.floor(capacity[None, :] / self.lengths[:, None])
        from . import kernels             # here, not at import: numba loads only where a batch is planned
        self._kernel = kernels
        self._kernel_args = (self.order, np.ascontiguousarray(self.lengths), np.ascontiguousarray(self.times),
                             np.minimum(held, 2.0 ** 52).astype(np.int64), np.asarray(charge, dtype=np.float64),
                             degrees.astype(np.int64), capacity, self.min_time * (1 + 1e-9))
        self._min_area, self._min_time = self.min_area.tolist(), self.min_time.tolist()
        self._cache: dict[bytes, BinPacking | None] = {}
        self._placeable: dict[bytes, bool] = {}

    # --- bounds -------------------------------------------------------------------------------
    def lower_bound(self, counts: np.ndarray) -> float:
        """No packing beats perfect spreading of the cheapest area, nor the slowest sequence alone."""
        area, slowest = 0.0, -1.0          # a plain loop: the search asks for a hundred 16-bucket bounds a batch
        for count, min_area, min_time in zip(counts.tolist(), self._min_area, self._min_time):
            if count > 0:
                area += count * min_area
                if min_time > slowest:
                    slowest = min_time
        if slowest < 0:
            return 0.0
        spread = area / self.num_gpus
        return (spread if spread > slowest else slowest) + self.costs.beta1

    # --- one target -------------------------------------------------------------------------
    def pack(self, counts: np.ndarray, makespan: float, max_gpus: float | None = None,
             stretch: bool = False) -> BinPacking | None:
        """Groups whose bucketed time stays within ``makespan``, or None if they need more than
        ``max_gpus`` GPUs (default N; pass ``math.inf`` to pack a whole batch into any number).

        ``stretch``: a sequence slower than ``makespan`` even alone at its best degree gets a group
        of its own time instead of failing (used to pack a whole batch, where such a group will
        set the pace of its own micro-batch)."""
        return self._best(counts, makespan, 0.0, 0, self.num_gpus if max_gpus is None else max_gpus, stretch)

    def _best(self, counts: np.ndarray, makespan: float, lo: float, max_iter: int, max_gpus: float = math.inf,
              stretch: bool = False, rel_tol: float = 0.0) -> BinPacking | None:
        """``kernels.best_packing`` (the packing at ``makespan``, bisected towards ``lo``) as a ``BinPacking``."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        args = (counts, float(makespan), float(lo), float(rel_tol), int(max_iter), float(max_gpus), bool(stretch),
                float(self.costs.beta1), int(self.num_gpus))
        if self.costs.placeable is None:
            got = self._kernel.best_packing(*args, None, *self._kernel_args)
        else:
            got = self._kernel.best_packing_interpreted(*args, self._places, *self._kernel_args)
        n, degree_idx, mult, _, per_class, makespan = got
        return None if n < 0 else BinPacking(degree_idx=degree_idx, counts=per_class, makespan=makespan, mult=mult)

    def _places(self, per_degree: np.ndarray) -> bool:
        """Whether groups of these counts per degree get ranks in one micro-batch (``DegreeCosts.placeable``), cached."""
        key = per_degree.tobytes()
        if key not in self._placeable:
            self._placeable[key] = self.costs.places(per_degree)
        return self._placeable[key]

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
        # from ``below`` when given (most callers' packings are already as good as the packer finds, and then
        # its one packing answers None instead of a whole bisection), else from the memory-only packing
        return self._best(counts, below, lo, max_iter, self.num_gpus, rel_tol=rel_tol)
