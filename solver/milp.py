"""The paper's MILP on bucketed lengths, solved by HiGHS (scipy.optimize.milp).

Variables: ``n[m, j, b]`` sequences of bucket ``b`` in group slot ``j`` of micro-batch ``m``
(integer), ``y[m, j]`` whether the slot is used (binary), ``T[m]`` the micro-batch's makespan.
Slots are enumerated per degree (at most ``N/d`` of degree ``d`` per micro-batch).

    min  sum_m T[m]
    s.t. sum_{m,j} n[m,j,b] = count[b]                          every sequence once
         sum_b L[b] n[m,j,b] <= capacity[j] y[m,j]               memory
         sum_b t[b,j] n[m,j,b] + beta1 y[m,j] <= T[m]            makespan
         sum_j degree[j] y[m,j] <= N                            GPUs
         y[m,j] >= y[m,j'] for consecutive slots of one degree; the p-th longest sequence in
         micro-batches 0..p only                                   (symmetry)

With one bucket per distinct length it is exact; the search uses it to prove tiny instances
optimal and to polish single micro-batches. HiGHS stops at ``time_limit`` and hands back its best
feasible point, which the caller keeps only if it beats the heuristic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .group_packing import BinPacking
from .types import DegreeCosts

# Relative gap HiGHS must close before it stops (scipy's default is HiGHS's 1e-4). HiGHS also stops
# at an absolute gap of 1e-6 s, far below any plan difference a caller compares at 1e-6 relative.
MIP_REL_GAP = 1e-9


@dataclass
class MilpResult:
    packings: list[BinPacking]        # one per non-empty micro-batch
    counts: np.ndarray                # [M, B] bucket counts per micro-batch
    objective: float
    optimal: bool


def solve_milp(bucket_lengths: np.ndarray, bucket_times: np.ndarray, counts: np.ndarray, costs: DegreeCosts,
               num_gpus: int, num_micro_batches: int, time_limit: float,
               upper_bound: float | None = None) -> MilpResult | None:
    """Minimise the sum of micro-batch makespans; None when HiGHS finds no feasible point in time.

    Solved to ``MIP_REL_GAP``: HiGHS's default (1e-4) stops at a point up to 0.01% worse than the
    optimum, which is no proof on tiny batches where two plans can differ by less than that."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # slow to import; only MILP users pay
    from scipy.sparse import coo_matrix
    lengths = np.asarray(bucket_lengths, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    nb, nm = len(lengths), num_micro_batches
    total = int(counts.sum())
    slot_k = []
    for k, d in enumerate(costs.degrees):
        if d <= num_gpus and (lengths[counts > 0] <= costs.capacity[k]).any():
            slot_k += [k] * min(num_gpus // d, total)
    slot_k = np.asarray(slot_k, dtype=np.int64)
    ns = len(slot_k)
    cap = np.asarray(costs.capacity)[slot_k]
    deg = np.asarray(costs.degrees)[slot_k]
    t = np.where(np.isfinite(bucket_times), bucket_times, 0.0)[:, slot_k].T     # [S, B]

    n_idx = np.arange(nm * ns * nb).reshape(nm, ns, nb)
    y_idx = nm * ns * nb + np.arange(nm * ns).reshape(nm, ns)
    t_idx = nm * ns * nb + nm * ns + np.arange(nm)
    nvar = t_idx[-1] + 1

    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(row_cols, row_vals, low, high):
        nonlocal r
        rows.extend([r] * len(row_cols))
        cols.extend(row_cols)
        vals.extend(row_vals)
        lo.append(low)
        hi.append(high)
        r += 1

    for b in range(nb):
        add(n_idx[:, :, b].ravel().tolist(), [1.0] * (nm * ns), counts[b], counts[b])
    for m in range(nm):
        for j in range(ns):
            add(n_idx[m, j].tolist() + [y_idx[m, j]], lengths.tolist() + [-cap[j]], -np.inf, 0.0)
            add(n_idx[m, j].tolist() + [y_idx[m, j], t_idx[m]], t[j].tolist() + [costs.beta1, -1.0], -np.inf, 0.0)
        add(y_idx[m].tolist(), deg.astype(float).tolist(), -np.inf, float(num_gpus))
        for j in range(ns - 1):
            if slot_k[j] == slot_k[j + 1]:
                add([y_idx[m, j], y_idx[m, j + 1]], [1.0, -1.0], 0.0, np.inf)
    if upper_bound is not None:
        add(t_idx.tolist(), [1.0] * nm, -np.inf, upper_bound)

    a = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    upper = np.full(nvar, np.inf)
    fits = lengths[None, :] <= cap[:, None]                                      # [S, B]
    upper[n_idx] = np.where(fits[None, :, :], counts[None, None, :], 0)
    # Symmetry between micro-batches: with buckets sorted longest first, the p-th sequence may only
    # open micro-batches 0..p (the classic bin-packing rule), so bucket b stays below its last position.
    order = np.argsort(-lengths, kind="stable")
    last_pos = np.empty(nb, dtype=np.int64)
    last_pos[order] = np.cumsum(counts[order]) - 1
    for m in range(nm):
        upper[n_idx[m][:, last_pos < m]] = 0
    upper[y_idx] = 1.0
    integrality = np.ones(nvar)
    integrality[t_idx] = 0
    cost = np.zeros(nvar)
    cost[t_idx] = 1.0
    res = milp(cost, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nvar), upper), options={"time_limit": max(time_limit, 0.01), "disp": False, "mip_rel_gap": MIP_REL_GAP})
    if res.x is None:
        return None
    x = np.rint(res.x).astype(np.int64)
    n = x[n_idx]
    used = x[y_idx] > 0
    packings, per_mb = [], []
    for m in range(nm):
        keep = used[m] & (n[m].sum(axis=1) > 0)
        if not keep.any():
            continue
        group_times = (n[m][keep] * t[keep]).sum(axis=1)
        packings.append(BinPacking(slot_k[keep], n[m][keep], float(group_times.max()) + costs.beta1))
        per_mb.append(n[m][keep].sum(axis=0))
    return MilpResult(packings, np.array(per_mb), float(sum(p.makespan for p in packings)), res.status == 0)
