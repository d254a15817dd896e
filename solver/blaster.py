"""The sequence blaster: split a global batch that does not fit one pass into micro-batches.

Every split works on sequences sorted longest first and returns the micro-batch of each sequence.
``consecutive`` is the paper's rule (consecutive chunks of the sorted lengths, so long sequences
share micro-batches); ``interleaved`` spreads them (longest-processing-time first on the cheapest
GPU-seconds of each sequence, under the memory limit), which wins when one long sequence would
otherwise leave most GPUs idle. The search tries both, at several micro-batch counts.
"""
from __future__ import annotations

import heapq

import numpy as np

from .counting import check_deadline

# ``critical_fill`` loops over micro-batches in plain Python up to this many (measured: about 3x faster
# than numpy at 1-8, where each call's fixed cost dominates), and on arrays above it.
NUMPY_FROM = 32


def min_micro_batches(tokens: float, cluster_capacity: float) -> int:
    """Fewest micro-batches whose memory could hold ``tokens`` (a bound, not always reachable)."""
    return max(1, int(np.ceil(tokens / cluster_capacity - 1e-12)))


def consecutive(order: np.ndarray, weights: np.ndarray, num_micro_batches: int) -> np.ndarray:
    """Cut the sorted sequences into chunks of about equal total ``weights``."""
    w = weights[order]
    cum = np.cumsum(w) - 0.5 * w                       # each sequence's midpoint in the running total
    chunk = np.minimum((cum / w.sum() * num_micro_batches).astype(np.int64), num_micro_batches - 1)
    out = np.empty(len(order), dtype=np.int64)
    out[order] = chunk
    return out


def interleaved(order: np.ndarray, weights: np.ndarray, tokens: np.ndarray, num_micro_batches: int,
                token_limit: float, deadline: float | None = None) -> np.ndarray | None:
    """Longest first, each sequence to the micro-batch with the least weight that still has memory.

    Returns None when some sequence finds no micro-batch with room. Skipping full micro-batches
    can make one call quadratic, so it raises ``OutOfTime`` once past ``deadline``.
    """
    heap = [(0.0, m) for m in range(num_micro_batches)]
    used = np.zeros(num_micro_batches)
    out = np.empty(len(order), dtype=np.int64)
    pops = 0
    for i in order:
        skipped = []
        while heap:
            pops += 1
            if pops % 4096 == 0:
                check_deadline(deadline)
            load, m = heapq.heappop(heap)
            if used[m] + tokens[i] <= token_limit:
                break
            skipped.append((load, m))
        else:
            return None
        out[i] = m
        used[m] += tokens[i]
        heapq.heappush(heap, (load + weights[i], m))
        for item in skipped:
            heapq.heappush(heap, item)
    return out


def critical_fill(order: np.ndarray, area: np.ndarray, critical: np.ndarray, tokens: np.ndarray,
                  num_micro_batches: int, num_gpus: int, token_limit: float) -> np.ndarray | None:
    """Longest first, each sequence where it raises the micro-batch's estimated makespan least.

    A micro-batch's estimate is ``max(slowest sequence alone, area / N)``: long sequences gather in
    the same micro-batches (they share one critical path) and short ones fill the idle GPU-time
    beside them before they add to any micro-batch. Returns None when memory runs out.
    """
    if num_micro_batches > NUMPY_FROM:
        return _critical_fill_arrays(order, area, critical, tokens, num_micro_batches, num_gpus, token_limit)
    # plain floats: a handful of micro-batches per sequence, where numpy's per-call cost is most of the work
    crit, load, used = [0.0] * num_micro_batches, [0.0] * num_micro_batches, [0.0] * num_micro_batches
    out = np.empty(len(order), dtype=np.int64)
    for i, c_i, a_i, t_i in zip(order.tolist(), critical[order].tolist(), area[order].tolist(), tokens[order].tolist()):
        best, best_key = -1, None
        for m in range(num_micro_batches):
            if used[m] + t_i > token_limit:
                continue
            spread = load[m] / num_gpus
            before = crit[m] if crit[m] > spread else spread
            top = crit[m] if crit[m] > c_i else c_i
            grown = (load[m] + a_i) / num_gpus
            key = ((top if top > grown else grown) - before, before)   # least rise, then least loaded
            if best_key is None or key < best_key:
                best, best_key = m, key
        if best < 0:
            return None
        out[i] = best
        if c_i > crit[best]:
            crit[best] = c_i
        load[best] += a_i
        used[best] += t_i
    return out


def _critical_fill_arrays(order: np.ndarray, area: np.ndarray, critical: np.ndarray, tokens: np.ndarray,
                          num_micro_batches: int, num_gpus: int, token_limit: float) -> np.ndarray | None:
    """``critical_fill`` on arrays, for many micro-batches: the same choices (least rise, then least
    loaded, then the first)."""
    crit = np.zeros(num_micro_batches)
    load = np.zeros(num_micro_batches)
    used = np.zeros(num_micro_batches)
    out = np.empty(len(order), dtype=np.int64)
    for i in order:
        before = np.maximum(crit, load / num_gpus)
        after = np.maximum(np.maximum(crit, critical[i]), (load + area[i]) / num_gpus)
        delta = after - before
        delta[used + tokens[i] > token_limit] = np.inf
        m = int(np.lexsort((before, delta))[0])
        if not np.isfinite(delta[m]):
            return None
        out[i] = m
        crit[m] = max(crit[m], critical[i])
        load[m] += area[i]
        used[m] += tokens[i]
    return out
