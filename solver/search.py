"""FlexSP's planner: split the batch into micro-batches and pack each, searching over both.

1. Bucket the batch (DP, ``num_buckets``) so every later step costs O(buckets x group classes).
2. Candidate splits: the sequence blaster's (``blaster``: the paper's consecutive chunks of sorted
   lengths, an interleaved and a critical-path-aware split, at micro-batch counts from the memory
   bound upwards), each micro-batch packed by bisection on its makespan (``group_packing``); and a sweep
   that packs the whole batch at a target makespan and deals the groups into micro-batches
   (``arranged_split``), which picks the micro-batch count and the split together.
3. A budgeted first-improvement local search moves sequences of one bucket between micro-batches;
   ``evict`` empties the most wasteful micro-batch of whole buckets into the others and ``merge``
   packs two short micro-batches as one.
4. Back to real sequences, rebalanced on real lengths (``materialize``); each micro-batch re-packed
   on buckets of its own and its slowest groups tightened (``tighten``); the MILP (``milp``) can
   polish micro-batches; the best of all candidates and the baselines'
   plans (``fallbacks``), scored on real lengths, wins, so FlexSP is never slower than a plan it
   could have chosen.

Tiny batches (``exact_max_sequences``) skip all of this: ``exact.exact_plan`` returns their optimum in
milliseconds (the MILP proves the few it cannot do).

Splits that cannot win are not packed: a split whose micro-batches' lower bounds (``bound``) already
sum to the best makespan so far is dropped before its bisections, so pruning never changes the plan.

Micro-batch counts are searched (``counting``), never stepped one at a time. Every budget is
counted in work, never in seconds: sweep points (``arranged_candidates``), the window of counts
(``extra_micro_batches``), local-search trials (``max_moves``), re-packing variants
(``REFINE_VARIANTS``), ``tighten`` steps, and which fallbacks run (``MAX_FALLBACK_SEQUENCES``). So the
plan depends only on the inputs and options, on an idle or a loaded machine. The wall-clock
``deadline`` is a safety net: it stops the search early (keeping the best valid plan so far; a
one-pass plan exists before anything else runs) only when it binds, and ``plan_batch`` says so
(``Plan.meta["time_limit_hit"]`` and a ``TimeLimitWarning``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import blaster
from .bucketing import MAX_DP_CANDIDATES, RULES, Buckets, exact_buckets
from .counting import OutOfTime, search_count
from .group_packing import BinPacking, MicroBatchPacker
from .materialize import as_groups, to_groups, to_members
from .exact import exact_plan
from .milp import solve_milp
from .one_gpu import one_gpu_plan
from .tighten import tighten_members
from .types import (DegreeCosts, GroupAssignment, GroupColumns, Groups, Infeasible, Schedule, flat_ids, group_loads,
                    group_sizes)

# Other strategies' plans (``fallbacks``) are tried on batches up to this many sequences. Above it
# the search has the most room and their plans never won in experiments/scale_benchmark.py (FlexSP
# >= 1.12x faster than each from 8,192 sequences up), while planning them costs about as much
# as FlexSP's own search (~1 s of CPU at 131,072 sequences). A size rule, not a time rule: the
# plan must not depend on how loaded the machine is.
MAX_FALLBACK_SEQUENCES = 16384
# Per-micro-batch re-packing in ``refine``: (buckets at the default num_buckets=16, estimate). None: as many
# buckets as ``bucketing.MAX_DP_CANDIDATES``, which the DP rule turns into a bucket per distinct length (or its
# quantile candidates above that many; no DP runs). Upper times on exact lengths fix most long-sequence groups and
# the compiled packer makes them cheap. Against the 48 buckets this replaced: gpt-7b constants at 16,384 GPUs
# 1.086 -> 1.073 of the bound, at 4,096 1.089 -> 1.080; the pace batches, the paper setting, Wikipedia and long-mix
# within 0.1%.
REFINE_VARIANTS = ((16, "mean"), (None, "upper"))
# Blaster splits that loop over sequences in Python are skipped above this batch size.
MAX_PER_SEQUENCE_SPLITS = 8192
# ``apart_candidate``: sequences needing more than APART_DEGREE GPUs' memory planned on their own, then
# the rest, on batches of more than APART_SEQUENCES[0] sequences where some sequence needs more than
# APART_TRIGGER_DEGREE GPUs' memory. Rules measured in experiments/scale_benchmark.py (batches of 8 x N):
# with such a sequence (long-mix; or a single 1.5M-token sequence among Wikipedia's) the joint search
# left 1.18-1.21 of the lower bound at 16,384 GPUs and the apart plan 1.03-1.07, never worse; without
# one (Wikipedia, the gpt-7b constants: longest 10-33 GPUs) the apart plan lost every batch (4,096 and
# 16,384 GPUs: about 1.28 against 1.08-1.10). Up to APART_SEQUENCES[1] both plans are made and the
# faster kept; above it the joint search is skipped (two searches would double the 16,384-GPU solve).
# Below APART_SEQUENCES[0] it hardly ever won (1 of 20 paper-setting batches, by 0.3%).
APART_DEGREE = 8
APART_TRIGGER_DEGREE = 64
APART_SEQUENCES = (MAX_PER_SEQUENCE_SPLITS, 4 * MAX_PER_SEQUENCE_SPLITS)
# ``search_plan`` on batches above MAX_PER_SEQUENCE_SPLITS refines the greedy split only when its
# bucketed makespan is within this of the searched splits' (the benchmarks' flips were within 0.3%).
FIRST_MARGIN = 0.01
# ``BatchSearch.evict``: buckets of the most wasteful micro-batch tried for eviction.
EVICT_BUCKETS = 8
# ``BatchSearch.merge``: pairs of micro-batches packed as one, at most.
MERGE_TRIALS = 8
# Splits refined on batches above MAX_PER_SEQUENCE_SPLITS (best bucketed makespan first): a refine
# of a 16,384-GPU batch costs ~0.1 s of CPU.
MAX_REFINED_LARGE = 3
# ``search_plan`` under a deadline: the search for splits stops at this share of the time left, so the
# refinement on real lengths (about a quarter of a 16,384-GPU solve) still runs. A search cut at the deadline
# itself left its best split unrefined: gpt-7b at 16,384 GPUs, 1.36 of the lower bound instead of 1.09.
SEARCH_SHARE = 0.6
# ``sweep_points``: the makespan sweep's points (a third as many again below the slowest sequence).
# Measured on the pace table's 135 batches of 16-64 sequences on 4-16 GPUs (12-16 points): plans 1.00009x
# as long on average (8 slower by at most 0.84%, 6 faster by up to 0.92%) for 9-19% less solve time; 8
# points left one plan 2.9% slower. Counting sequences alone also cut the sweep of a few long sequences
# planned apart on thousands of GPUs (long-mix, 4,096 GPUs: 1.054 -> 1.062 of the lower bound), hence
# the points per degree.
SWEEP_POINTS = 24
MIN_SWEEP_POINTS = 12
SEQUENCES_PER_SWEEP_POINT = 4
POINTS_PER_DEGREE = 3
# Relative shave of ``BatchSearch.bound`` (float rounding must never prune a split that ties).
BOUND_SLACK = 1e-9
# ``BatchSearch.bounds`` takes numpy from this many rows on (below, numpy's per-call overhead is most of it).
BOUNDS_VECTORISED_FROM = 16


@dataclass(frozen=True)
class SearchOptions:
    num_buckets: int = 16           # the paper's default
    extra_micro_batches: int = 2    # micro-batch counts tried above the memory bound
    max_moves: int = 30             # local-search trials (packings of two micro-batches each)
    # ... on batches above MAX_PER_SEQUENCE_SPLITS sequences, where the local search keeps finding
    # moves: long-mix at 16,384 GPUs 1.114 -> 1.099 of the bound (about +0.3 s of CPU at most there);
    # at 512 sequences 400 trials would double the solve time for no gain
    max_moves_large: int = 400
    exact_max_sequences: int = 8    # up to this many sequences the plan is proven optimal (exact.py's DP, else the MILP)
    milp_time_limit: float = 0.0    # seconds of MILP polishing per micro-batch on larger batches
    bucketing: str = "dp"           # bucketing rule (solver.bucketing.RULES): "dp" (the paper's) or "naive"
    sort_longest_first: bool = True  # the blaster cuts lengths sorted longest first (False: arrival order)

    def __post_init__(self) -> None:
        if self.bucketing not in RULES:
            raise ValueError(f"bucketing must be one of {sorted(RULES)}, got {self.bucketing!r}")


Members = tuple[list[np.ndarray], np.ndarray]     # one micro-batch: each group's ids, degree indices


@dataclass
class Refined:
    """Refined micro-batches as ``Members`` and the plan's real time (the sum of their makespans)."""

    micro_batches: list[Members]
    time: float


@dataclass
class Split:
    """Micro-batch of each sequence plus the packing of each micro-batch."""

    assignment: np.ndarray
    packings: list[BinPacking]

    @property
    def makespan(self) -> float:
        return float(sum(p.makespan for p in self.packings))


def sweep_points(num_sequences: int, num_degrees: int) -> int:
    """Makespans the sweep packs the whole batch at: ``SWEEP_POINTS``, fewer on small problems, whose
    whole-batch packing changes at fewer makespans (a bucket moves to another degree, a group takes one
    more sequence): one per ``SEQUENCES_PER_SWEEP_POINT`` sequences or ``POINTS_PER_DEGREE`` per degree,
    whichever is more, at least ``MIN_SWEEP_POINTS``."""
    wanted = max(MIN_SWEEP_POINTS, num_sequences // SEQUENCES_PER_SWEEP_POINT, POINTS_PER_DEGREE * num_degrees)
    return min(SWEEP_POINTS, wanted)


def distinct_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``matrix``'s distinct rows (in order of first appearance) and each row's index among them: what
    ``np.unique(axis=0, return_inverse=True)`` gives up to row order, without its sort of structured
    views (a tenth of a small batch's solve)."""
    first: dict[bytes, int] = {}
    inverse = np.array([first.setdefault(row.tobytes(), len(first)) for row in matrix], dtype=np.int64)
    keep = np.zeros(len(first), dtype=np.int64)
    keep[inverse[::-1]] = np.arange(len(matrix))[::-1]
    return matrix[keep], inverse


def mean_bucket_times(lengths: np.ndarray, buckets: Buckets, costs: DegreeCosts,
                      per_seq: np.ndarray | None = None, ids: np.ndarray | None = None) -> np.ndarray:
    """``[B, D]`` average real time of each bucket's sequences per degree: unbiased, unlike the
    time of the bucket's upper bound. ``per_seq``: ``[n, D]`` seconds of a whole batch's sequences at each
    degree, if the caller has them, with ``ids`` the rows that are ``lengths`` (None: all, in order).
    Compiled, the sums read those rows in place (``kernels.bucket_sums``); else each degree's column is
    gathered and summed by ``bincount``, in the same order (the same means bit for bit)."""
    from . import kernels
    nb = len(buckets.upper)
    counts = np.maximum(buckets.counts, 1)
    if per_seq is None:
        per_seq, ids = costs.all_seconds(lengths), None
    if ids is None:
        ids = np.arange(len(per_seq))
    if kernels.COMPILED:
        return kernels.bucket_sums(per_seq, np.asarray(ids, dtype=np.int64), buckets.index, nb) / counts[:, None]
    return np.stack([np.bincount(buckets.index, weights=column, minlength=nb) / counts for column in per_seq[ids].T],
                    axis=1)


def sequence_seconds(lengths: np.ndarray, costs: DegreeCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n, D]`` seconds of every sequence at every degree (memory aside), and each one's least seconds and least
    GPU-seconds among the degrees that hold it: one compiled pass (``kernels.seconds_table``) or numpy's, the
    same numbers bit for bit."""
    from . import kernels
    if kernels.COMPILED:
        return kernels.seconds_table(np.asarray(lengths, dtype=np.float64), costs._quad, costs._lin, costs._ring,
                                     costs._hops, np.asarray(costs.capacity, dtype=np.float64),
                                     np.asarray(costs.degrees, dtype=np.float64))
    per_seq = costs.all_seconds(lengths)
    real = costs.times(lengths, per_seq)                                  # inf where one does not fit
    return per_seq, real.min(axis=1), (real * np.asarray(costs.degrees)[None, :]).min(axis=1)


class BatchSearch:
    def __init__(self, lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, options: SearchOptions,
                 deadline: float | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.costs = costs
        self.num_gpus = num_gpus
        self.options = options
        self.deadline = deadline if deadline is not None else math.inf   # None: stop at the move limits only
        self.cut_short = False                                   # a deadline stopped some step
        longest = self.lengths.max()
        if longest > costs.capacity[-1]:
            raise Infeasible(f"a sequence of {longest} tokens is longer than the whole cluster can hold "
                             f"({costs.capacity[-1]:.0f} tokens on {costs.degrees[-1]} GPUs)")
        self.bucket = RULES[options.bucketing]
        self.buckets: Buckets = self.bucket(self.lengths, options.num_buckets)
        # every sequence at every degree, once: the bucket means here and in ``refine_members``, the real times here
        # and in ``batch_bound``
        self.per_seq, self.real_time, self.real_area = sequence_seconds(self.lengths, costs)   # per_seq: [n, D]
        self.packer = MicroBatchPacker(self.buckets.upper, costs, num_gpus,
                                       mean_bucket_times(self.lengths, self.buckets, costs, self.per_seq))
        self.order = (np.argsort(-self.lengths, kind="stable") if options.sort_longest_first
                      else np.arange(len(self.lengths)))
        self.fastest = self.packer.times.min(axis=1)           # per bucket, seconds at its fastest degree
        self._bound_terms = list(zip(self.packer.min_area.tolist(), self.fastest.tolist()))   # ``bound``'s, as floats
        self.seq_area = self.packer.min_area[self.buckets.index]
        self.seq_critical = self.packer.min_time[self.buckets.index]
        self.seq_tokens = self.buckets.rounded().astype(np.float64)
        self.cluster_tokens = costs.capacity[0] * num_gpus   # capacity is linear in degree
        self.num_buckets = len(self.buckets.upper)
        # each bucket's sequences in search order (``assign_from_counts`` deals them out, longest first)
        by_bucket = self.order[np.argsort(self.buckets.index[self.order], kind="stable")]
        self.bucket_members = np.split(by_bucket, np.cumsum(self.buckets.counts)[:-1])
        self._refined: dict[bytes, tuple] = {}                   # refine_members' results by their input
        self._swept: set[bytes] = set()                          # whole-batch packings arranged_split dealt
        self._materialized: dict[tuple, tuple] = {}              # members' micro-batches by (ids, packing)

    def out_of_time(self) -> bool:
        late = time.perf_counter() > self.deadline
        self.cut_short |= late
        return late

    # --- evaluating splits --------------------------------------------------------------------
    def counts(self, assignment: np.ndarray, num_mb: int) -> np.ndarray:
        flat = assignment * self.num_buckets + self.buckets.index
        return np.bincount(flat, minlength=num_mb * self.num_buckets).reshape(num_mb, self.num_buckets)

    def evaluate(self, assignment: np.ndarray, memory_only: bool = False, beat: float = math.inf) -> Split | None:
        """Pack every micro-batch (identical micro-batches once); None when one does not fit.

        ``memory_only`` (or a deadline that has passed) packs at an unbounded makespan: one pass
        per micro-batch instead of a bisection, still a valid split, used to find the count.
        ``beat``: None, without packing, when the micro-batches' lower bounds already sum to at
        least this (the split cannot beat a plan of that makespan)."""
        num_mb = int(assignment.max()) + 1
        rows, inverse = distinct_rows(self.counts(assignment, num_mb))
        if beat < math.inf and self.bound_sum(rows, inverse) >= beat:
            return None
        solved = []
        for row in rows:
            if not row.any():
                solved.append(None)
                continue
            fast = memory_only or self.out_of_time()
            packing = self.packer.pack_memory(row) if fast else self.packer.solve(row)
            if packing is None:
                return None
            solved.append(packing)
        packings = [solved[i] for i in inverse.ravel() if solved[i] is not None]
        # renumber micro-batches densely (an empty one may have been dropped): a micro-batch's new number
        # is how many non-empty ones come before it (np.unique's rank, without its sort of the batch)
        present = np.bincount(assignment, minlength=num_mb) > 0
        return Split((np.cumsum(present) - 1)[assignment], packings)

    def bound(self, row: np.ndarray) -> float:
        """No packing of these bucket counts on N GPUs has a smaller bucketed makespan: the cheapest
        area spread over N, or the slowest bucket at its fastest degree, on the packer's own (mean)
        times, plus beta1; shaved by ``BOUND_SLACK`` so float rounding never prunes a tie. (The
        packer's ``lower_bound`` takes upper-length times for the critical path, which a packing on
        mean times may undercut.)"""
        area, slowest = 0.0, -1.0          # a plain loop: the search asks for thousands of 16-bucket bounds
        for count, (min_area, fastest) in zip(row.tolist(), self._bound_terms):
            if count > 0:
                area += count * min_area
                if fastest > slowest:
                    slowest = fastest
        if slowest < 0:
            return 0.0
        spread = area / self.num_gpus
        return ((spread if spread > slowest else slowest) + self.costs.beta1) * (1 - BOUND_SLACK)

    def bounds(self, rows: np.ndarray) -> np.ndarray:
        """``bound`` of every row of ``rows`` at once, bit for bit: the area is summed bucket by bucket in
        the same order (a cumulative sum; a bucket a row lacks adds an exact 0.0), so a split pruned here
        is one ``bound`` would prune."""
        rows = np.asarray(rows)
        if len(rows) < BOUNDS_VECTORISED_FROM:
            return np.array([self.bound(row) for row in rows], dtype=np.float64)
        present = rows > 0
        area = np.cumsum(np.where(present, rows * self.packer.min_area, 0.0), axis=1)[:, -1]
        slowest = np.where(present, self.fastest, -1.0).max(axis=1)
        spread = area / self.num_gpus
        out = (np.maximum(spread, slowest) + self.costs.beta1) * (1 - BOUND_SLACK)
        out[slowest < 0] = 0.0
        return out

    def bound_sum(self, rows: np.ndarray, inverse: np.ndarray | None = None) -> float:
        """``bound`` summed over micro-batches (``rows``, repeated as ``inverse`` says): a split
        whose sum reaches a plan's makespan cannot beat it, so it need not be packed."""
        bounds = self.bounds(rows)
        return float(bounds.sum() if inverse is None else bounds[np.asarray(inverse).ravel()].sum())

    def candidates(self, num_mb: int):
        yield blaster.consecutive(self.order, self.seq_tokens, num_mb)
        yield blaster.consecutive(self.order, self.seq_area, num_mb)
        if len(self.lengths) <= MAX_PER_SEQUENCE_SPLITS:   # per-sequence loops; the sweep covers big batches
            yield blaster.interleaved(self.order, self.seq_area, self.seq_tokens, num_mb, self.cluster_tokens)
            yield blaster.critical_fill(self.order, self.seq_area, self.seq_critical, self.seq_tokens, num_mb,
                                        self.num_gpus, self.cluster_tokens)

    def first_split(self) -> Split:
        """The greedy plan: the best of the makespan sweep's memory-only point (one pass, found
        first so a plan exists however soon the deadline falls), the paper's consecutive split at
        the fewest micro-batches that pack, and a few more sweep points, while time remains.

        The consecutive split's count is searched, not stepped: galloping up from the memory
        bound, then bisection, on memory-only packings (O(log gap) splits); only the chosen split
        is packed by bisection."""
        best = self.arranged_split(math.inf, must_finish=True)
        lo = blaster.min_micro_batches(self.seq_tokens.sum(), self.cluster_tokens)

        def fits(num_mb: int) -> bool:
            if self.out_of_time():
                raise OutOfTime
            return self.evaluate(blaster.consecutive(self.order, self.seq_tokens, num_mb), memory_only=True) is not None

        try:
            count = search_count(fits, lo, len(best.packings))
        except OutOfTime:
            return best
        for weights in (self.seq_tokens, self.seq_area):
            if self.out_of_time():
                return best
            split = self.evaluate(blaster.consecutive(self.order, weights, count))
            if split is not None and split.makespan < best.makespan:
                best = split
        return self.arranged_candidates(points=3, low_points=0, best=best)

    def arranged_split(self, makespan: float, must_finish: bool = False, beat: float = math.inf) -> Split | None:
        """Pack the whole batch into groups of at most ``makespan`` (any number of GPUs), then deal
        the groups, slowest first, into micro-batches of N GPUs (first fit). One pass finds the
        micro-batch count and the split together; sweeping ``makespan`` trades the two. Past the
        deadline it gives up (None) unless ``must_finish``, and skips re-packing micro-batches.
        ``beat``: gives up (None) as soon as the micro-batches re-packed so far plus the lower bounds
        of the rest reach it (the split cannot beat a plan of that makespan).

        First fit runs on group classes: per degree, a pointer to the first micro-batch with room
        only moves forward (room only shrinks), so dealing costs O(classes + micro-batches)."""
        packing = self.packer.pack(self.buckets.counts, makespan, max_gpus=math.inf, stretch=True)
        if packing is None:
            return None
        if not must_finish:
            # a sweep point whose whole-batch packing an earlier one had deals the same split, which was
            # compared with a best that has only improved since (same outcome, nothing repacked)
            key = b"|".join((packing.degree_idx.tobytes(), packing.counts.tobytes(), packing.multiplicity().tobytes()))
            if key in self._swept:
                return None
            self._swept.add(key)
        times = self.packer.group_times(packing)
        degrees = np.asarray(self.costs.degrees)[packing.degree_idx]
        room: list[int] = []
        first_with_room: dict[int, int] = {}
        pieces: list[list[tuple[int, int]]] = []              # per micro-batch: (class, groups)
        held: list[np.ndarray] = []                           # per micro-batch: groups per degree index
        for c in np.argsort(-times, kind="stable"):
            d, k, left = int(degrees[c]), int(packing.degree_idx[c]), int(packing.multiplicity()[c])
            m = first_with_room.get(d, 0)
            while left:
                while m < len(room) and (room[m] < d or self._placed(held[m], k, 1) == 0):
                    m += 1
                if m == len(room):
                    room.append(self.num_gpus)
                    pieces.append([])
                    held.append(np.zeros(len(self.costs.degrees), dtype=np.int64))
                take = self._placed(held[m], k, min(left, room[m] // d)) or 1   # one alone always places
                room[m] -= take * d
                held[m][k] += take
                pieces[m].append((int(c), take))
                left -= take
            first_with_room[d] = m
        # each micro-batch's bucket counts: its classes' multiplicities times their counts, one product
        # for all (a dealt packing is built only for the micro-batches looked at before ``beat`` stops it)
        weights = np.zeros((len(pieces), len(times)), dtype=np.int64)
        for m, mine in enumerate(pieces):
            for c, q in mine:
                weights[m, c] = q
        rows = weights @ packing.counts
        left = self.bound_sum(rows) if beat < math.inf else 0.0      # bounds of the micro-batches not yet packed
        if left >= beat:
            return None
        packings, total = [], 0.0
        for mine, row in zip(pieces, rows):
            cls = np.array([c for c, _ in mine])
            arranged = BinPacking(packing.degree_idx[cls], packing.counts[cls], float(times[cls].max()) + self.costs.beta1,
                                  np.array([q for _, q in mine]))
            late = self.out_of_time()
            if late and not must_finish:
                return None
            resolved = None if late else self.packer.solve(row, below=arranged.makespan)
            packings.append(resolved if resolved is not None and resolved.makespan < arranged.makespan else arranged)
            if beat < math.inf:
                total += packings[-1].makespan
                left -= self.bound(row)
                if total + left >= beat:
                    return None
        return Split(self.assign_from_counts(rows), packings)

    def _placed(self, held: np.ndarray, k: int, most: int) -> int:
        """How many of ``most`` more groups of degree index ``k`` a micro-batch holding ``held`` takes and
        still gets ranks: all of them where degrees nest; else the most that place (a bisection: a group
        more never helps a placement; one group alone always places)."""
        if self.costs.placeable is None or most == 0:
            return most
        trial = held.copy()
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            trial[k] = held[k] + mid
            if self.costs.places(trial):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def arranged_candidates(self, points: int | None = None, low_points: int | None = None,
                            best: Split | None = None) -> Split | None:
        """The best of ``best`` and the sweep's splits (points that cannot beat the best so far
        are cut short, so the result is the same as packing every point fully). ``points``: by default
        ``sweep_points`` of the batch."""
        points = sweep_points(len(self.lengths), len(self.costs.degrees)) if points is None else points
        beta1 = self.costs.beta1
        loose = self.packer.pack(self.buckets.counts, math.inf, max_gpus=math.inf)
        hi = loose.makespan - beta1
        critical = min(float(self.packer.min_time[self.buckets.counts > 0].max()), hi)
        # dense between the slowest sequence and the memory-only packing (where plans usually
        # land), sparse below it (a lone long sequence gets its own, longer micro-batch)
        low_points = points // 3 if low_points is None else low_points
        budgets = np.concatenate([np.geomspace(critical, hi, points), np.geomspace(0.1 * hi, critical, low_points + 1)[:-1]])
        for budget in budgets:
            if self.out_of_time():
                break
            makespan = beta1 + float(budget)
            split = self.arranged_split(makespan, beat=math.inf if best is None else best.makespan)
            if split is not None and (best is None or split.makespan < best.makespan):
                best = split
        return best

    def best_split(self, start: Split | None = None) -> Split:
        """The best bucketed split over ``start`` (default: the greedy split), blaster candidates and
        makespan sweeps (before local search)."""
        best = self.arranged_candidates(best=start if start is not None else self.first_split())
        if self.out_of_time():
            return best
        lo = blaster.min_micro_batches(self.seq_tokens.sum(), self.cluster_tokens)
        first_mb, extra = len(best.packings), self.options.extra_micro_batches
        for num_mb in range(max(lo, first_mb - extra), max(lo, first_mb) + extra + 1):   # a window, not every count
            if num_mb > len(self.lengths):
                break
            for assignment in self.candidates(num_mb):
                if self.out_of_time():
                    return best
                if assignment is None:
                    continue
                split = self.evaluate(assignment, beat=best.makespan)
                if split is not None and split.makespan < best.makespan:
                    best = split
        return best

    # --- local search -------------------------------------------------------------------------
    def improve(self, split: Split) -> Split:
        """Move sequences of one bucket from the most wasteful micro-batch to another while the sum
        of makespans drops. Deterministic: a fixed scan order and a trial budget."""
        num_mb = len(split.packings)
        if num_mb < 2:
            return split
        counts = self.counts(split.assignment, num_mb)
        packings = list(split.packings)
        trials = 0
        moved = False
        improved = True
        limit = self.options.max_moves_large if len(self.lengths) > MAX_PER_SEQUENCE_SPLITS else self.options.max_moves
        while improved and len(packings) > 1 and trials < limit and not self.out_of_time():
            improved = False
            for src, b, dst, qty in self._moves(packings, counts):
                if trials >= limit or self.out_of_time():
                    break
                trials += 1
                new_src, new_dst = counts[src].copy(), counts[dst].copy()
                new_src[b] -= qty
                new_dst[b] += qty
                before = packings[src].makespan + packings[dst].makespan
                if self.bound(new_dst) + self.bound(new_src) >= before * (1 - 1e-9):
                    continue                   # cannot be kept: skip packing it (the trial still counts)
                # each packing is asked only for a makespan that could still be kept (None: none is)
                p_dst = self.packer.solve(new_dst, below=before - self.bound(new_src))
                if p_dst is None:
                    continue
                if p_dst.makespan + self.bound(new_src) >= before * (1 - 1e-9):
                    continue                   # cannot be kept whatever the source packs to
                p_src = self.packer.solve(new_src, below=before - p_dst.makespan) if new_src.any() else None
                if new_src.any() and p_src is None:
                    continue
                after = p_dst.makespan + (p_src.makespan if p_src is not None else 0.0)
                if after < before * (1 - 1e-9):
                    counts[src], counts[dst] = new_src, new_dst
                    packings[src], packings[dst] = p_src, p_dst
                    if p_src is None:          # the source micro-batch is now empty
                        counts = np.delete(counts, src, axis=0)
                        del packings[src]
                    improved = moved = True
                    break
        # no move kept: the same split (so it is not materialised and refined a second time)
        return Split(self.assign_from_counts(counts), packings) if moved else split

    def evict(self, split: Split) -> Split:
        """Empty the most wasteful micro-batch of whole buckets, shortest first, into the others.

        A micro-batch whose makespan a long sequence sets can hold short sequences that, memory-bound
        on their GPUs, idle most of it while taking GPUs the long groups could run faster on; the
        local search moves one or half a bucket at a time to one micro-batch and tries the long
        buckets first, so it rarely gets there. Each step moves all of one bucket's sequences out,
        dealt to the other micro-batches with memory room (fastest first), and is kept when the sum
        of makespans drops. At most ``EVICT_BUCKETS`` buckets tried (work, not time)."""
        num_mb = len(split.packings)
        if num_mb < 2:
            return split
        counts = self.counts(split.assignment, num_mb)
        packings = list(split.packings)
        waste = [p.makespan - self.bound(c) for p, c in zip(packings, counts)]
        src = int(np.argmax(waste))
        moved = False
        tokens = self.buckets.upper.astype(np.float64)
        for b in np.flatnonzero(counts[src])[:EVICT_BUCKETS]:
            if self.out_of_time():
                break
            left = int(counts[src, b])
            new = counts.copy()
            new[src, b] = 0
            room = self.cluster_tokens - new @ tokens
            for dst in np.argsort([p.makespan for p in packings], kind="stable"):
                if dst == src or left == 0:
                    continue
                take = min(left, int(room[dst] // tokens[b]))
                new[dst, b] += take
                left -= take
            if left:
                continue
            changed = [m for m in range(num_mb) if m == src or new[m, b] != counts[m, b]]
            before = sum(packings[m].makespan for m in changed)
            # pack the changed micro-batches in turn; stop once the packed ones plus the bounds of
            # the rest reach ``before`` (the step cannot be kept: same outcome, fewer packings)
            trial, after, left = {}, 0.0, sum(self.bound(new[m]) for m in changed)
            for m in changed:
                left -= self.bound(new[m])
                # asked only for a makespan that could still be kept (None: none is)
                trial[m] = self.packer.solve(new[m], below=before - after - left) if new[m].any() else None
                if trial[m] is None and new[m].any():
                    break
                after += trial[m].makespan if trial[m] is not None else 0.0
                if after + left >= before * (1 - 1e-9):
                    break
            if len(trial) < len(changed) or any(trial[m] is None and new[m].any() for m in changed):
                continue
            if after < before * (1 - 1e-9):
                counts = new
                for m in changed:
                    packings[m] = trial[m]
                moved = True
        if not moved:
            return split
        keep = [m for m in range(num_mb) if counts[m].any()]
        return Split(self.assign_from_counts(counts[keep]), [packings[m] for m in keep])

    def merge(self, split: Split) -> Split:
        """Pack pairs of micro-batches as one while that lowers the sum of makespans: the shortest
        with each of the next shortest in turn (two short micro-batches often fit one makespan and
        save a beta1 and their idle tails; moving one or half a bucket at a time never empties one).
        At most ``MERGE_TRIALS`` packings (work, not time)."""
        num_mb = len(split.packings)
        if num_mb < 2:
            return split
        counts = [row for row in self.counts(split.assignment, num_mb)]
        packings = list(split.packings)
        trials, moved = 0, False
        while len(packings) > 1 and trials < MERGE_TRIALS and not self.out_of_time():
            order = np.argsort([p.makespan for p in packings], kind="stable")
            a = int(order[0])
            for b in order[1:]:
                b = int(b)
                if trials >= MERGE_TRIALS:
                    break
                trials += 1
                union = counts[a] + counts[b]
                if self.bound(union) >= packings[a].makespan + packings[b].makespan:
                    continue
                packed = self.packer.solve(union, below=packings[a].makespan + packings[b].makespan)
                if packed is not None and packed.makespan < (packings[a].makespan + packings[b].makespan) * (1 - 1e-9):
                    counts[a], packings[a] = union, packed
                    del counts[b], packings[b]
                    moved = True
                    break
            else:
                break
        return Split(self.assign_from_counts(np.array(counts)), packings) if moved else split

    def _moves(self, packings: list[BinPacking], counts: np.ndarray):
        """Candidate moves (source, bucket, destination, count): the most wasteful micro-batch's
        longest buckets first, to the least wasteful micro-batches first."""
        waste = np.array([p.makespan - self.packer.lower_bound(c) for p, c in zip(packings, counts)])
        for src in np.argsort(-waste, kind="stable"):
            for b in np.flatnonzero(counts[src])[::-1]:
                for dst in np.argsort(waste, kind="stable"):
                    if dst != src:
                        for qty in sorted({1, int(counts[src, b] + 1) // 2}):
                            yield int(src), int(b), int(dst), qty

    def assign_from_counts(self, counts: np.ndarray) -> np.ndarray:
        """Give each micro-batch the right number of each bucket's sequences (longest to the first)."""
        assignment = np.empty(len(self.lengths), dtype=np.int64)
        for ids, column in zip(self.bucket_members, counts.T):
            assignment[ids] = np.repeat(np.arange(len(counts)), column)
        return assignment

    # --- MILP ---------------------------------------------------------------------------------
    def milp(self, incumbent: Schedule) -> Schedule | None:
        """Whole batch exactly when it is tiny; else each micro-batch alone, worst first."""
        bound = incumbent.time(self.lengths, self.costs)
        times = self.packer.times
        if len(self.lengths) <= self.options.exact_max_sequences:
            # one bucket per distinct length, whatever num_buckets and the rule: rounding would make
            # the MILP's optimum an approximation
            exact = exact_buckets(self.lengths)
            result = solve_milp(exact.upper, self.costs.times(exact.upper), exact.counts, self.costs, self.num_gpus,
                                len(self.lengths), self.remaining(), upper_bound=bound * (1 + 1e-9))
            if result is None:
                return None
            return self.exact_schedule(exact, result)
        micro_batches = list(incumbent.micro_batches)
        mb_times = incumbent.micro_batch_times(self.lengths, self.costs)
        for m in np.argsort(mb_times)[::-1]:
            budget = min(self.options.milp_time_limit, self.remaining())
            if budget <= 0:
                break
            ids = np.concatenate([g.seq_ids for g in micro_batches[m]])
            row = np.bincount(self.buckets.index[ids], minlength=self.num_buckets)
            result = solve_milp(self.buckets.upper, times, row, self.costs, self.num_gpus, 1, budget,
                                upper_bound=mb_times[m])
            if result is None or len(result.packings) != 1:
                continue
            groups = tuple(to_groups(result.packings[0], ids, self.buckets.index, self.lengths, self.costs))
            if max(g.time(self.lengths, self.costs) for g in groups) < mb_times[m]:
                micro_batches[m] = groups
        return Schedule(tuple(micro_batches))

    def exact_schedule(self, exact: Buckets, result) -> Schedule:
        """The MILP's micro-batches on exact buckets as real groups (every sequence of a bucket has
        the bucket's length, so dealing them is exact)."""
        micro_batches = []
        pools = [list(np.flatnonzero(exact.index == b)) for b in range(len(exact.upper))]
        for packing in result.packings:
            groups = []
            for k, row in zip(packing.degree_idx.tolist(), packing.counts):
                ids = [pools[b].pop() for b in np.flatnonzero(row) for _ in range(int(row[b]))]
                groups.append(GroupAssignment(self.costs.degrees[k], np.sort(np.array(ids, dtype=np.int64))))
            micro_batches.append(tuple(groups))
        return Schedule(tuple(micro_batches))

    def refine(self, schedule: Schedule) -> Schedule:
        """Re-pack each micro-batch on buckets of its own sequences: a micro-batch spans a narrower
        range of lengths than the batch, so its own buckets round far less (the paper buckets per
        micro-batch). Two variants: its own 16 buckets with mean times (unbiased for groups of
        many sequences), and a bucket per distinct length with upper times (its real times: the bisected
        makespan holds for groups of one or two long sequences). Keeps a micro-batch's new groups only when faster,
        then ``tighten``s its slowest groups (larger degree, merge, or move a sequence)."""
        index = {d: k for k, d in enumerate(self.costs.degrees)}
        return self.as_schedule(self.refine_members([([g.seq_ids for g in groups],
                                                      np.array([index[g.degree] for g in groups]))
                                                     for groups in schedule.micro_batches]))

    def refine_members(self, raw: list) -> Refined:
        """``refine`` on micro-batches given as (each group's ids, degree indices[, their seconds]), returning them in
        the same form with each micro-batch's real time: candidates are compared on these times and
        group objects are built once, for the plan that wins (``as_schedule``).

        Splits share most micro-batches (a local-search move changes two), so a micro-batch already
        refined from the same groups is taken from ``self._refined`` instead of re-packed and
        tightened: the same input gives the same output, so the plan does not change."""
        micro_batches: list = [mb[:2] for mb in raw]
        times = np.full(len(raw), np.nan)
        for m, item in enumerate(raw):
            members, deg = item[:2]
            key = self._members_key(members, deg)
            done = self._refined.get(key)
            if done is not None:
                micro_batches[m], times[m] = done[:2], done[2]
                continue
            loads = item[2] if len(item) > 2 else group_loads(members, deg, self.lengths, self.costs)
            cut = False
            ids = flat_ids(members)
            # no packing of these sequences has a slower group below their cheapest area spread over N
            # nor below the slowest one at its fastest degree: a micro-batch there keeps its groups
            floor = max(float(self.real_area[ids].sum()) / self.num_gpus, float(self.real_time[ids].max()))
            if (len(members) > 1 or len(ids) > 1) and loads.max() > floor * (1 - BOUND_SLACK):
                tried = None
                for num_buckets, estimate in REFINE_VARIANTS:
                    if self.out_of_time():
                        cut = True
                        break
                    local = self.bucket(self.lengths[ids], MAX_DP_CANDIDATES if num_buckets is None
                                        else num_buckets * self.options.num_buckets // 16)
                    if len(local.upper) == 1 and len(members) == 1:
                        break
                    upper = self.costs.times(local.upper)               # inf where one does not fit: as the packer
                    if estimate == "mean":
                        means = mean_bucket_times(self.lengths[ids], local, self.costs, self.per_seq, ids)
                        bucket_times = np.where(np.isfinite(upper), means, np.inf)
                    else:
                        bucket_times = upper
                    # a micro-batch of few distinct lengths gets them as buckets in both variants, and then
                    # mean and upper times agree: the same packing twice, packed once
                    same = (tried is not None and np.array_equal(local.upper, tried[0])
                            and np.array_equal(local.counts, tried[1]) and np.array_equal(bucket_times, tried[2]))
                    tried = (local.upper, local.counts, bucket_times)
                    if same:
                        continue
                    # only a packing below the groups it has could be kept (a margin above it measured no better)
                    packing = MicroBatchPacker(local.upper, self.costs, self.num_gpus, bucket_times).solve(
                        local.counts, below=float(loads.max()) + self.costs.beta1)
                    if packing is None:
                        continue
                    bucket_of = np.zeros(len(self.lengths), dtype=np.int64)
                    bucket_of[ids] = local.index
                    new_members, new_deg, new_loads = to_members(packing, ids, bucket_of, self.lengths, self.costs,
                                                                 with_loads=True)
                    if new_loads.max() < loads.max():
                        members, deg, loads = new_members, new_deg, new_loads
            if not cut:
                members, deg, loads = tighten_members(members, deg, self.lengths, self.costs, self.num_gpus,
                                                      self.deadline, loads, with_loads=True)
            micro_batches[m] = (members, deg)
            times[m] = float(loads.max()) + self.costs.beta1
            if cut:              # past the deadline: the rest stay as they are
                rest = [mb[:2] for mb in raw[m + 1:]]
                micro_batches[m + 1:] = rest
                times[m + 1:] = [float(group_loads(mm, dd, self.lengths, self.costs).max()) + self.costs.beta1
                                 for mm, dd in rest]
                break
            if not self.out_of_time():       # a cut-short tighten is not what a later call would give
                self._refined[key] = (members, deg, times[m])
        return Refined(micro_batches, float(times.sum()))

    @staticmethod
    def _members_key(members, deg) -> bytes:
        """The groups of a micro-batch as bytes (ids in group order, group sizes, degrees): equal keys, equal input."""
        return b"|".join((flat_ids(members).astype(np.int64).tobytes(), group_sizes(members).astype(np.int64).tobytes(),
                          np.asarray(deg, dtype=np.int64).tobytes()))

    def real_bound(self, split: Split) -> float:
        """No refinement of ``split`` (its micro-batches keep their sequences) beats this, on real
        lengths: per micro-batch the cheapest area of its sequences spread over N, or its slowest
        sequence at its fastest degree, plus beta1; shaved by ``BOUND_SLACK``."""
        num_mb = len(split.packings)
        area = np.bincount(split.assignment, weights=self.real_area, minlength=num_mb) / self.num_gpus
        from . import kernels
        if kernels.COMPILED:
            slowest = kernels.group_max(split.assignment, self.real_time, num_mb)
        else:
            slowest = np.zeros(num_mb)
            np.maximum.at(slowest, split.assignment, self.real_time)
        return float((np.maximum(area, slowest) + self.costs.beta1).sum()) * (1 - BOUND_SLACK)

    def batch_bound(self) -> float:
        """No plan of the whole batch beats this, on real lengths; a plan at it is optimal, so the search
        stops there. With ``P`` the plan's time and ``m`` its micro-batches, ``T = P - m * beta1`` is the sum
        of their slowest groups' loads, so every sequence runs at a degree where it takes at most ``T``, and
        the GPU-seconds of all of them fit in ``N * T``: ``T`` is at least the least ``T`` with
        ``T >= sum_i a_i(T) / N``, ``a_i(T)`` the cheapest area of sequence ``i`` among its degrees within
        ``T`` (a step function, found over its steps); ``m`` is at least the fewest micro-batches memory
        allows. This couples the critical path with the area (a long sequence at a high degree costs the
        others GPUs), which the per-micro-batch ``bound`` and ``real_bound`` do not."""
        times = self.costs.times(self.lengths, self.per_seq)            # [n, D], inf where it does not fit
        order = np.argsort(times, axis=1, kind="stable")                 # each sequence's degrees, fastest first
        by_time = np.take_along_axis(times, order, axis=1)
        area = np.take_along_axis(times * np.asarray(self.costs.degrees, dtype=np.float64)[None, :], order, axis=1)
        least = np.minimum.accumulate(area, axis=1)                      # a_i at each of its times (finite: the fastest fits)
        drops = least[:, 1:] < least[:, :-1]
        step_at, step = by_time[:, 1:][drops], (least[:, 1:] - least[:, :-1])[drops]
        critical = float(by_time[:, 0].max())                            # every sequence runs somewhere
        first = float(least[:, 0].sum() + step[step_at <= critical].sum())
        later = step_at > critical
        step_order = np.argsort(step_at[later], kind="stable")
        at = np.concatenate([[critical], step_at[later][step_order]])
        spread = np.concatenate([[first], first + np.cumsum(step[later][step_order])]) / self.num_gpus
        work = float(np.maximum(at, spread).min())
        per_gpu = max(c / d for c, d in zip(self.costs.capacity, self.costs.degrees))
        fewest = max(1, math.ceil(float(self.lengths.sum()) / (per_gpu * self.num_gpus) * (1 - 1e-12)))
        return work + fewest * self.costs.beta1

    def as_schedule(self, refined: Refined) -> Schedule:
        return Schedule(tuple(GroupColumns.of(members, deg, self.costs) for members, deg in refined.micro_batches))

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    # --- output -------------------------------------------------------------------------------
    def schedule(self, split: Split) -> Schedule:
        """Real-length groups for every micro-batch (without the per-sequence rebalancing once the
        deadline has passed)."""
        return Schedule(tuple(as_groups(mb[0], mb[1], self.costs) for mb in self.members(split)))

    def members(self, split: Split) -> list[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
        """``schedule`` as (each group's ids, degree indices, seconds) per micro-batch, for ``refine_members``.

        Splits share micro-batches (the local search, eviction and merging change a few), so a micro-batch
        with the same sequences and the same packing object as in an earlier split is taken from
        ``self._materialized`` (a 16,384-GPU Wikipedia batch: about 60% of them); nothing downstream
        changes these arrays in place."""
        out = []
        by_mb = np.argsort(split.assignment, kind="stable")
        bounds = np.searchsorted(split.assignment[by_mb], np.arange(len(split.packings) + 1))
        for m, packing in enumerate(split.packings):
            seq_ids = by_mb[bounds[m]:bounds[m + 1]]
            rebalanced = not self.out_of_time()
            key = (seq_ids.tobytes(), id(packing), rebalanced)
            done = self._materialized.get(key)
            if done is None or done[0] is not packing:      # the packing held in the entry keeps its id unique
                done = (packing, to_members(packing, seq_ids, self.buckets.index, self.lengths, self.costs,
                                            rebalanced=rebalanced, with_loads=True))
                self._materialized[key] = done
            out.append(done[1])
        return out


def greedy(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, options: SearchOptions = SearchOptions(),
           deadline: float | None = None) -> Schedule:
    search = BatchSearch(lengths, costs, num_gpus, options, deadline)
    return search.schedule(search.first_split())


def apart_candidate(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, options: SearchOptions,
                    deadline: float | None) -> Schedule | None:
    """The sequences that need more than ``APART_DEGREE`` GPUs' memory planned on their own, then the
    rest, one plan after the other (None when either part is empty).

    On long-tailed batches the joint search can leave a few very long sequences sharing micro-batches
    with thousands of short ones that then idle or run at needlessly high degrees; planning them apart
    took the worst 4,096-GPU long-mix batch from 1.285 to 1.053 of the coupled bound (all three
    batches to <= 1.053), while on the paper's 64-GPU setting it won once in 20 batches, by 0.3%."""
    held = held_within(costs, APART_DEGREE)
    if held is None:
        return None
    is_long = lengths > held
    if not is_long.any() or is_long.all():
        return None
    parts, cut = [], False
    for ids in (np.flatnonzero(is_long), np.flatnonzero(~is_long)):
        part = search_plan(lengths[ids], costs, num_gpus, options, deadline=deadline, apart=False)
        parts.extend(GroupColumns(mb.degrees, Groups(ids[mb.ids.flat], mb.ids.sizes)) if isinstance(mb, GroupColumns)
                     else tuple(GroupAssignment(g.degree, ids[g.seq_ids]) for g in mb) for mb in part.micro_batches)
        cut |= part.cut_short
    return Schedule(tuple(parts), cut_short=cut)


def held_within(costs: DegreeCosts, degree: int) -> float | None:
    """Tokens the largest group of at most ``degree`` GPUs holds (None: no degree that small)."""
    fits = [k for k, d in enumerate(costs.degrees) if d <= degree]
    return costs.capacity[fits[-1]] if fits else None


def needs_apart(lengths: np.ndarray, costs: DegreeCosts) -> bool:
    """Whether some sequence needs more than ``APART_TRIGGER_DEGREE`` GPUs' memory while some other fits
    ``APART_DEGREE`` GPUs (else there is nothing to plan apart)."""
    short, trigger = held_within(costs, APART_DEGREE), held_within(costs, APART_TRIGGER_DEGREE)
    if short is None or trigger is None:
        return False
    return bool(lengths.max() > trigger and lengths.min() <= short)


def search_plan(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int, options: SearchOptions = SearchOptions(),
           fallbacks: tuple[Callable[[], Schedule], ...] = (), deadline: float | None = None,
           apart: bool = True) -> Schedule:
    """The best of: the greedy split, the searched splits, the MILP where it runs, and the plans of
    ``fallbacks`` (other strategies), all scored on real lengths.

    The greedy split (the only one when the deadline falls first; on bigger batches than
    ``MAX_PER_SEQUENCE_SPLITS`` only when within ``FIRST_MARGIN`` of the others), the searched split and the locally improved one
    are turned into real groups and refined, and compared on their real times (bucketed estimates can
    rank splits wrongly by a few percent); group objects are built for the winner only. Every step is
    bounded in work; the ``deadline`` only cuts it short (safety net), returning the best plan so far.
    ``fallbacks`` run on batches of at most ``MAX_FALLBACK_SEQUENCES``. A big batch with a sequence needing
    more than ``APART_TRIGGER_DEGREE`` GPUs is also planned with its long sequences apart
    (``apart_candidate``): beside the joint search up to ``APART_SEQUENCES[1]`` sequences, instead of it above.
    """
    proven = one_gpu_plan(lengths, costs, num_gpus)
    if proven is not None:
        return proven                        # one GPU, fewest micro-batches: nothing can beat it
    if len(lengths) <= options.exact_max_sequences:
        proven = exact_plan(np.asarray(lengths), costs, num_gpus)
        if proven is not None:
            return proven                    # the optimum (subset DP): nothing can beat it
    planned_apart = apart and len(lengths) > APART_SEQUENCES[0] and needs_apart(np.asarray(lengths), costs)
    if planned_apart and len(lengths) > APART_SEQUENCES[1]:
        candidate = apart_candidate(np.asarray(lengths), costs, num_gpus, options, deadline)
        if candidate is not None:
            return candidate                 # no fallbacks above MAX_FALLBACK_SEQUENCES: nothing to compare with
    search = BatchSearch(lengths, costs, num_gpus, options, deadline)
    score = lambda schedule: schedule.time(search.lengths, costs)    # noqa: E731
    hard = search.deadline
    # a plan at the batch's bound (up to float rounding) is optimal: the search stops at the first split
    # that refines to it (the refinement loop below takes the others from ``refine_members``' cache)
    bound = search.batch_bound() * (1 + BOUND_SLACK) if len(lengths) <= MAX_PER_SEQUENCE_SPLITS else -math.inf

    def optimal(split: Split) -> Schedule | None:
        # a split whose micro-batches' own bounds already exceed the batch's cannot refine to it: not refined
        # here (the loop below refines it only if it can still win)
        if bound <= 0 or search.real_bound(split) > bound:
            return None
        refined = search.refine_members(search.members(split))
        if refined is None or refined.time > bound:
            return None
        search.deadline = hard
        return marked(search.as_schedule(refined), search.cut_short)

    first = search.first_split()             # under the whole time limit, as the greedy strategy has it
    if (proven := optimal(first)) is not None:
        return proven
    if math.isfinite(hard):                  # the rest of the split search leaves time to refinement
        now = time.perf_counter()
        search.deadline = min(hard, now + SEARCH_SHARE * max(0.0, hard - now))
    splits = [first]
    if not search.out_of_time():
        searched = search.best_split(first)
        if (proven := optimal(searched)) is not None:
            return proven
        splits = [first, searched]
        if not search.out_of_time() and options.max_moves > 0:
            improved = search.improve(searched)
            if improved is not searched and (proven := optimal(improved)) is not None:
                return proven
            splits.append(improved)
        # evict from both the searched and the improved split (the local search can move past the
        # split eviction helps most), then merge on the best so far
        for split in splits[1:]:
            if search.out_of_time():
                break
            evicted = search.evict(split)
            if all(evicted is not other for other in splits):
                splits.append(evicted)
        if not search.out_of_time():
            merged = search.merge(min(splits[1:], key=lambda split: split.makespan))
            if all(merged is not other for other in splits):
                splits.append(merged)
        # The greedy split's bucketed makespan is never below the searched ones'. On big batches its
        # refined plan won only when the two were within a few tenths of a percent (real lengths can
        # reorder that close): it is refined there only within ``FIRST_MARGIN`` (a refine of a
        # 16,384-GPU batch costs ~0.15 s of CPU).
        if len(lengths) > MAX_PER_SEQUENCE_SPLITS and first.makespan > (1 + FIRST_MARGIN) * min(
                split.makespan for split in splits[1:]):
            splits = splits[1:]
    search.deadline = hard
    # refined on real lengths, best bucketed estimate first (each split once)
    refined: Refined | None = None
    done: list[Split] = []
    for split in sorted(splits, key=lambda split: split.makespan):
        if refined is not None and search.out_of_time():
            break
        if any(split is other for other in done):
            continue
        if len(lengths) > MAX_PER_SEQUENCE_SPLITS and len(done) >= MAX_REFINED_LARGE:
            break
        done.append(split)
        if refined is not None and search.real_bound(split) >= refined.time:
            continue                         # cannot beat the refined plan so far: same plan, less work
        candidate = search.refine_members(search.members(split))
        if refined is None or candidate.time < refined.time:
            refined = candidate
    best = search.as_schedule(refined)
    if refined.time <= bound:
        return marked(best, search.cut_short)   # optimal: no other strategy's plan nor the MILP can beat it
    if planned_apart and not search.out_of_time():
        candidate = apart_candidate(search.lengths, costs, num_gpus, options, deadline)
        if candidate is not None and score(candidate) < score(best):
            best = candidate
    if len(lengths) > MAX_FALLBACK_SEQUENCES and not (len(lengths) <= options.exact_max_sequences or options.milp_time_limit > 0):
        return marked(best, search.cut_short)   # nothing left to compare with
    best_time = score(best)
    if len(lengths) <= MAX_FALLBACK_SEQUENCES:
        # past the deadline too: the other strategies' plans are cheap (0.25 s at 16,384 sequences) and a
        # cut-short search must still return a plan no worse than theirs
        for fallback in fallbacks:
            candidate = fallback()
            if score(candidate) < best_time and candidate.places(costs):
                best, best_time = candidate, score(candidate)
    if len(lengths) <= options.exact_max_sequences or options.milp_time_limit > 0:
        polished = search.milp(best)
        if polished is not None and score(polished) < best_time and polished.places(costs):
            best = polished
    return marked(best, search.cut_short)


def marked(schedule: Schedule, cut_short: bool) -> Schedule:
    """``schedule`` flagged ``cut_short`` when the search that chose it was."""
    return Schedule(schedule.micro_batches, cut_short=True) if cut_short and not schedule.cut_short else schedule
