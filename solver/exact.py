"""Tiny batches solved exactly by dynamic programming over subsets, in milliseconds.

A plan is a partition of the sequences into micro-batches, each a partition into groups with a
degree each, the degrees of a micro-batch summing to at most N. With ``n`` sequences (at most
``MAX_SEQUENCES``) every subset is a bitmask below ``2**n``, and two tables give the optimum:

* ``f[g][S]``: the least makespan (without ``beta1``) of the sequences ``S`` packed into groups on at
  most ``g`` GPUs: the group holding ``S``'s lowest sequence is some ``T`` at some degree ``d``, so
  ``f[g][S] = min over T, d of max(load(T, d), f[g - d][S \\ T])``;
* ``h[S]``: the least step time of ``S`` in micro-batches: ``min over T of f[N][T] + beta1 + h[S \\ T]``.

Each is a minimum over the ``(3**n - 1) / 2`` pairs ``(S, T)`` with ``T`` a subset of ``S`` holding
its lowest sequence, evaluated for all pairs at once with numpy: one pass per GPU count ``g`` for
``f`` and one per subset size for ``h``. The GPU counts are only the ones a micro-batch can leave
free (``N`` less the degrees of at most ``n - 1`` groups), a few for small clusters. The result is
the optimum of the same model the MILP solves (``solver.milp`` on one bucket per distinct length)
and the brute force of ``tests/validator.py`` enumerates, found without a solver or a deadline:
0.5-1 s of HiGHS for 8 sequences on 4 GPUs becomes about a millisecond.

Placement is counted in GPUs (the degrees of a micro-batch sum to at most N), which is exact for
degrees that nest (powers of two); for other sets (``DegreeCosts.placeable``) a plan whose
micro-batch does not place is not returned (None), and the caller searches as before.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .types import DegreeCosts, GroupAssignment, Schedule

# Up to this many sequences: (3**n - 1) / 2 pairs (S, T), 3,280 at 8 and 29,524 at 10.
MAX_SEQUENCES = 10
# GPU counts a micro-batch can leave free, at most: beyond it the f table would cost more than the
# heuristic search (huge clusters with powers of two from 1 to N and a tiny batch).
MAX_FREE_COUNTS = 256


@lru_cache(maxsize=MAX_SEQUENCES + 1)
def subset_pairs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(S, T, S \\ T)`` for every non-empty bitmask ``S < 2**n`` and every ``T`` inside ``S``
    holding ``S``'s lowest bit, sorted by ``S`` (so a minimum per ``S`` is one ``reduceat``)."""
    out_s, out_t = [], []
    for s in range(1, 1 << n):
        low = s & -s
        rest = s ^ low
        sub = rest
        while True:                      # every subset of ``rest``, each with ``low`` added
            out_s.append(s)
            out_t.append(sub | low)
            if sub == 0:
                break
            sub = (sub - 1) & rest
    s_arr = np.asarray(out_s, dtype=np.int64)
    t_arr = np.asarray(out_t, dtype=np.int64)
    for a in (s_arr, t_arr):
        a.flags.writeable = False
    rest = s_arr ^ t_arr
    rest.flags.writeable = False
    return s_arr, t_arr, rest


def _subset_sums(values: np.ndarray) -> np.ndarray:
    """``[2**n, ...]``: the sum of ``values[i]`` over the bits ``i`` of each mask."""
    n = len(values)
    out = np.zeros((1 << n,) + values.shape[1:], dtype=np.float64)
    for i in range(n):
        out[1 << i: 2 << i] = out[: 1 << i] + values[i]
    return out


def _free_counts(degrees: list[int], num_gpus: int, groups: int) -> list[int] | None:
    """GPU counts left free after at most ``groups - 1`` groups (ascending); None past ``MAX_FREE_COUNTS``."""
    seen = {num_gpus}
    layer = {num_gpus}
    for _ in range(groups - 1):
        layer = {g - d for g in layer for d in degrees if d <= g} - seen
        seen |= layer
        if len(seen) > MAX_FREE_COUNTS:
            return None
        if not layer:
            break
    return sorted(seen)


def exact_plan(lengths: np.ndarray, costs: DegreeCosts, num_gpus: int) -> Schedule | None:
    """The optimal plan of at most ``MAX_SEQUENCES`` sequences, or None when this method does not
    apply (too many sequences or free GPU counts, or its plan does not place on non-nesting degrees).
    Raises nothing for an infeasible batch: None, and the search names the problem."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    degrees = [int(d) for d in costs.degrees]
    usable = [k for k, d in enumerate(degrees) if d <= num_gpus]
    if not 0 < n <= MAX_SEQUENCES or not usable:
        return None
    free = _free_counts([degrees[k] for k in usable], num_gpus, n)
    if free is None:
        return None
    pair_s, pair_t, pair_r = subset_pairs(n)
    starts = np.flatnonzero(np.r_[True, pair_s[1:] != pair_s[:-1]])   # first pair of each S (S = 1, 2, ...)
    tokens = _subset_sums(lengths.astype(np.float64))                    # [2**n]
    seq_times = np.stack([costs.seconds(lengths, k) for k in range(costs.num_degrees)], axis=1)   # [n, D]
    fits = tokens[:, None] <= np.asarray(costs.capacity)[None, :]       # a group holds its members
    loads = np.where(fits, _subset_sums(seq_times), np.inf)             # [2**n, D]: a group's seconds, no beta1
    # f[g]: least makespan of each subset on g free GPUs; the empty set takes 0 anywhere
    f: dict[int, np.ndarray] = {}
    for g in free:
        best = np.full(len(pair_s), np.inf)
        for k in usable:
            below = g - degrees[k]
            if below < 0:
                continue
            rest = f.get(below)
            after = np.where(pair_r == 0, 0.0, np.inf) if rest is None else rest[pair_r]
            np.minimum(best, np.maximum(loads[pair_t, k], after), out=best)
        table = np.empty(1 << n)
        table[0] = 0.0
        table[1:] = np.minimum.reduceat(best, starts)
        f[g] = table
    step = f[num_gpus] + costs.beta1                                     # one micro-batch of each subset
    step[0] = 0.0
    # h: least step time of each subset, by subset size (S \ T is smaller than S)
    size = np.array([bin(s).count("1") for s in range(1 << n)])
    h = np.full(1 << n, np.inf)
    h[0] = 0.0
    value = np.full(len(pair_s), np.inf)
    for p in range(1, n + 1):
        layer = size[pair_s] == p
        value[layer] = step[pair_t[layer]] + h[pair_r[layer]]
        done = np.minimum.reduceat(value, starts)
        h[1:][size[1:] == p] = done[size[1:] == p]
    full = (1 << n) - 1
    if not np.isfinite(h[full]):
        return None
    schedule = Schedule(tuple(_groups(mb, f, loads, degrees, usable, num_gpus, pair_s, pair_t, pair_r, starts)
                              for mb in _micro_batches(full, step, h, pair_t, pair_r, starts)))
    return schedule if schedule.places(costs) else None


def _pairs_of(s: int, starts: np.ndarray, count: int) -> slice:
    return slice(int(starts[s - 1]), int(starts[s]) if s < len(starts) else count)


def _micro_batches(full: int, step: np.ndarray, h: np.ndarray, pair_t, pair_r, starts) -> list[int]:
    """The micro-batches (bitmasks) of an optimal split, read back from ``h``."""
    out, s = [], full
    while s:
        span = _pairs_of(s, starts, len(pair_t))
        t = pair_t[span][int(np.argmin(step[pair_t[span]] + h[pair_r[span]]))]
        out.append(int(t))
        s ^= int(t)
    return out


def _groups(mb: int, f: dict, loads: np.ndarray, degrees: list[int], usable: list[int], num_gpus: int,
            pair_s, pair_t, pair_r, starts) -> tuple[GroupAssignment, ...]:
    """The groups of micro-batch ``mb`` (a bitmask), read back from ``f``."""
    groups, s, g = [], mb, num_gpus
    while s:
        span = _pairs_of(s, starts, len(pair_t))
        best, choice = np.inf, None
        for k in usable:
            below = g - degrees[k]
            if below < 0:
                continue
            rest = f.get(below)
            after = np.where(pair_r[span] == 0, 0.0, np.inf) if rest is None else rest[pair_r[span]]
            values = np.maximum(loads[pair_t[span], k], after)
            i = int(np.argmin(values))
            if values[i] < best:
                best, choice = values[i], (int(pair_t[span][i]), k)
        t, k = choice
        ids = np.array([i for i in range(t.bit_length()) if t >> i & 1], dtype=np.int64)
        groups.append(GroupAssignment(degrees[k], ids))
        s ^= t
        g -= degrees[k]
    return tuple(groups)
