"""A lower bound tighter than ``coupled_lower_bound``, for reports that want to say how far a plan is from optimal.

The coupled LP (``flexsp.plan.bounds``) pools each micro-batch's GPUs: its memory and GPU-seconds are sums
over all of them, and a micro-batch of rank ``j`` may run sequences as long as ``(S - w_j) / j``. Two things
a real plan cannot do hide in that pooling:

* GPUs in a group of degree ``d`` run only that group's sequences, at degree ``d``'s rates. Pooled, the
  memory a long sequence's group leaves free on its GPUs is filled with short sequences at one-GPU rates.
  Here each micro-batch splits its ``N`` GPUs into ``G[d]`` per degree, each degree with its own memory
  (``G[d] x capacity[d] / d`` tokens) and its own GPU-seconds (``G[d] x`` the micro-batch's time).
* Every micro-batch lasts as long as its slowest group, and the spans add up. Pooled, the largest
  micro-batch may use its whole budget while the others' GPU-seconds are charged as an average. Here each
  micro-batch has its time ``tau_j`` (a variable), the ``tau_j`` sum to at most ``S``, none exceeds the
  largest, ``tau_0``, and the GPU-seconds of each are at most ``N tau_j``.

The per-degree rows multiply ``G[d]`` by a time, which would make the program bilinear, so ``tau_0`` is
confined to an interval ``[a, b]``: a sequence runs in the largest micro-batch only at degrees that finish it
within ``b``, and each degree's GPUs there give at most ``b`` seconds each; in the others, ``min(b, (S - a) / j,
(S - w_j) / (j + 1))``. Over an interval that is a relaxation of every plan whose largest micro-batch lasts
between ``a`` and ``b``, so the least feasible ``S`` (bisected) bounds them. Intervals are split where their
bound is lowest (best first) for a fixed number of LP solves; the minimum over the intervals bounds
every plan of that micro-batch count, and the count's coupled bound stays a floor.

Two counting cuts hold in every group of degree ``d`` and are added per micro-batch: at most one sequence
longer than half its memory (``capacity[d] / 2``), and at most one whose time exceeds half the micro-batch's.

Cost: a few LPs of ``buckets x degrees x micro-batches`` variables per solve, ``REFINE_SOLVES`` solves per
micro-batch count at most (2-6 s on a 16,384-GPU batch of 131,072 sequences, on this project's 2-core machine);
it is meant for benchmarks and reports, not the planning loop (``flexsp simulate`` keeps the coupled bound).
"""
from __future__ import annotations

import heapq
import math

import numpy as np
from scipy.sparse import coo_matrix

from flexsp.plan.bounds import SAFETY, CountBounds, coupled_by_count
from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel

# LP solves per micro-batch count (a deterministic budget: the same batch gives the same bound on any machine)
REFINE_SOLVES = 120
# Before branching, intervals of the largest micro-batch's time up to FIRST_REACH above the coupled span (plans sit
# a few percent above it) and one interval beyond; each interval's bisection on ``S`` stops at REL_TOL
FIRST_INTERVALS = 8
FIRST_REACH = 0.1
REL_TOL = 2e-4


def refined_lower_bound(lengths, cost: CostModel, cluster: Cluster, max_degree: int | None = None,
                        degrees=None, solves: int = REFINE_SOLVES) -> float:
    """The bound of the module docstring: never above any plan's time, never below ``coupled_lower_bound``."""
    coupled = coupled_by_count(lengths, cost, cluster, max_degree, degrees)
    beta1 = coupled.costs.beta1
    best = coupled.above
    # the most promising count first; a count's refined bound is at least its coupled one, so once that reaches
    # the best refined so far, neither it nor any later count can lower the answer
    for count in sorted(coupled.by_count, key=coupled.by_count.get):
        value = coupled.by_count[count]
        if value >= best:
            break
        # past ``best`` another count gives the answer anyway; with none yet, past 4x the span need not be tight
        cap = best if math.isfinite(best) else value + 3 * (value - count * beta1)
        span = _refine(count, value - count * beta1, cap - count * beta1, coupled, cluster.num_gpus, solves)
        best = min(best, count * beta1 + span)
    return float(best) * (1 - SAFETY)


def _refine(count: int, span_lo: float, span_cap: float, coupled: CountBounds, num_gpus: int,
            solves: int) -> float:
    """Least ``S`` over intervals of the largest micro-batch's time ``tau_0 in [S / count, S]``, best first; at
    least ``span_lo`` (the coupled bound), at most ``span_cap`` (no tighter answer is needed).

    Each leaf ``(value, a, b, hi, known)`` says: with ``tau_0`` in ``[a, b]``, no ``S`` below ``value`` is
    feasible, and ``hi`` is (``known``) or is the next guess for a feasible one. Every solve goes to the leaf
    with the least value: it bisects ``[value, hi]``, raises ``value`` to an infeasible guess (then guesses
    twice as far), or, once ``value`` is within ``REL_TOL`` of a known ``hi``, splits the interval (each half
    is at least as constrained, so starts from the same ``value``). A guess at ``span_cap`` is bisected as if
    known: every value it reaches was found infeasible. The least value is a bound at every step."""
    program = _Program(count, coupled, num_gpus)
    low = max(span_lo / count, float(coupled.seq_time.min(axis=1).max()))
    if low >= span_cap:
        return max(span_lo, span_cap)
    top = min(span_cap, span_lo * (1 + FIRST_REACH))
    edges = np.linspace(low, top, FIRST_INTERVALS + 1)
    if top < span_cap:
        edges = np.append(edges, span_cap)
    leaves = []
    for a, b in zip(edges, edges[1:]):
        value = max(span_lo, a)                       # S >= tau_0 >= a
        leaves.append((value, a, b, min(span_cap, value * (1 + 16 * REL_TOL)), False))
    heapq.heapify(leaves)
    while solves > 0:
        value, a, b, hi, known = leaves[0]
        if value >= span_cap:
            break
        if known and hi - value <= REL_TOL * hi:
            if b - a <= REL_TOL * value:
                break
            heapq.heappop(leaves)
            mid = (a + b) / 2
            for part in ((a, mid), (mid, b)):
                heapq.heappush(leaves, (value, *part, hi, False))
            continue
        heapq.heappop(leaves)
        probe = (value + hi) / 2 if known else hi
        solves -= 1
        if program.feasible(probe, a, b):
            heapq.heappush(leaves, (value, a, b, probe, True))
        elif known:
            heapq.heappush(leaves, (probe, a, b, hi, True))
        else:
            guess = min(span_cap, probe + 2 * max(probe - value, 16 * REL_TOL * probe))
            heapq.heappush(leaves, (probe, a, b, guess, guess >= span_cap))
    # tau_0 above span_cap means S above it too
    return max(span_lo, min(leaves[0][0], span_cap))


class _Program:
    """The LP of one micro-batch count, rebuilt per ``(S, a, b)``: variables are each bucket's token share per
    degree and micro-batch (only where that degree finishes it in time and holds it), the GPUs per degree and
    micro-batch, and the micro-batches' times."""

    def __init__(self, count: int, coupled: CountBounds, num_gpus: int):
        costs = coupled.costs
        self.count, self.n = count, float(num_gpus)
        self.tokens, self.per_token, self.seq_time = coupled.tokens, coupled.per_token, coupled.seq_time
        self.forced = coupled.forced
        degrees = np.asarray(costs.degrees, dtype=np.float64)
        self.degrees = degrees
        self.gpu_memory = np.asarray(costs.capacity, dtype=np.float64) / degrees    # tokens per GPU, per degree
        self.fits = coupled.shortest[:, None] <= np.asarray(costs.capacity)[None, :]
        self.fits &= np.isfinite(self.per_token) & np.isfinite(self.seq_time)
        self.sequences = self.tokens / coupled.longest  # at least this many sequences in each bucket
        # a group of degree d holds at most one member of a bucket longer than half its memory
        self.half_memory = coupled.shortest[:, None] > np.asarray(costs.capacity)[None, :] / 2

    def budgets(self, span: float, a: float, b: float) -> np.ndarray:
        """Most seconds each micro-batch rank may last when the largest lasts between ``a`` and ``b``."""
        j = np.arange(self.count, dtype=np.float64)
        out = np.minimum(b, (span - self.forced[:self.count]) / (j + 1))
        out[1:] = np.minimum(out[1:], (span - a) / j[1:])
        return out

    def feasible(self, span: float, a: float, b: float) -> bool:
        """Whether some assignment fits the micro-batch count in ``span`` with ``tau_0`` in ``[a, b]``."""
        from scipy.optimize import linprog  # slow to import; only bound users pay
        m, n = self.count, self.n
        nb, nd = self.per_token.shape
        hi = self.budgets(span, a, b)
        if hi[0] < a or np.any(hi < 0):
            return False
        ok = self.fits[:, :, None] & (self.seq_time[:, :, None] <= hi[None, None, :] * (1 + 1e-12))
        bs, ds, js = np.nonzero(ok)
        nx = len(bs)
        tau = nx + nd * m                             # first tau column
        nvar = tau + m
        tok = self.tokens[bs]
        work = tok * self.per_token[bs, ds]           # GPU-seconds if the whole bucket runs there
        rows, cols, vals = [], [], []
        # rows, in blocks of nd * m per (degree, rank): memory, time per degree, and the two counting cuts
        cell = ds * m + js
        blocks = [tok / self.gpu_memory[ds], work / hi[js]]
        cut_memory = self.half_memory[bs, ds]
        cut_time = self.seq_time[bs, ds] > hi[js] / 2
        blocks.append(np.where(cut_memory, self.sequences[bs] * self.degrees[ds], 0.0))
        blocks.append(np.where(cut_time, self.sequences[bs] * self.degrees[ds], 0.0))
        for k, coef in enumerate(blocks):
            rows.append(k * nd * m + cell)
            cols.append(np.arange(nx))
            vals.append(coef / n)
            rows.append(k * nd * m + np.arange(nd * m))
            cols.append(nx + np.arange(nd * m))
            vals.append(np.full(nd * m, -1.0 / n))
        r = len(blocks) * nd * m
        # GPUs per rank
        rows.append(r + np.repeat(np.arange(m), nd))
        cols.append(nx + (np.arange(nd)[None, :] * m + np.arange(m)[:, None]).ravel())
        vals.append(np.full(nd * m, 1.0 / n))
        # GPU-seconds of rank j within N tau_j
        rows += [r + m + js, r + m + np.arange(m)]
        cols += [np.arange(nx), tau + np.arange(m)]
        vals += [work / n, np.full(m, -1.0)]
        # the times sum to at most S; none above the largest
        rows += [np.full(m, r + 2 * m), r + 2 * m + np.arange(1, m), r + 2 * m + np.arange(1, m)]
        cols += [tau + np.arange(m), tau + np.arange(1, m), np.full(m - 1, tau)]
        vals += [np.ones(m), np.ones(m - 1), -np.ones(m - 1)]
        nrows = r + 3 * m
        b_ub = np.zeros(nrows)
        b_ub[r:r + m] = 1.0
        b_ub[r + 2 * m] = span
        a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(nrows, nvar))
        a_eq = coo_matrix((np.ones(nx), (bs, np.arange(nx))), shape=(nb, nvar))
        bounds = np.zeros((nvar, 2))
        bounds[:nx, 1] = 1.0
        bounds[nx:tau, 1] = n
        bounds[tau:, 1] = hi
        bounds[tau] = (a, min(b, hi[0]))
        res = linprog(np.zeros(nvar), A_ub=a_ub.tocsr(), b_ub=b_ub, A_eq=a_eq.tocsr(), b_eq=np.ones(nb),
                      bounds=bounds, method="highs")
        return res.status != 2                        # only a proven infeasibility raises the bound
