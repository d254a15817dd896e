"""Turn bucket-count groups back into real sequences, then rebalance on the real lengths."""
from __future__ import annotations

import numpy as np

from .group_packing import BinPacking
from .types import DegreeCosts, GroupAssignment, Groups, assignment, group_loads, split_at

# LPT rebalancing loops over sequences at O(groups) each: skip it on big micro-batches,
# where many sequences per group make the dealt version balanced anyway.
MAX_REBALANCE_PAIRS = 1_000_000
MAX_REBALANCE_SEQUENCES = 1024
# With numba ``fill_groups`` and ``rebalance`` run ``kernels``' loops compiled at every size. Without it they run
# them interpreted up to this many groups (``fill_groups`` only up to PLAIN_MAX_SEQUENCES too), above it their
# numpy forms (a pass per bucket, or per sequence over arrays of the groups).
PLAIN_MAX_GROUPS = 64
PLAIN_MAX_SEQUENCES = 256


def fill_groups(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
                costs: DegreeCosts, with_loads: bool = False):
    """Deal each bucket's real sequences (longest first) round-robin over the groups that hold it,
    least-loaded group first, so the rounding-up of bucketing is spread evenly: ``kernels.deal_groups``, or
    without numba on big micro-batches numpy per bucket; both deal alike.
    ``with_loads``: also each group's seconds on real lengths (the dealing computes them anyway)."""
    from . import kernels
    small = int(packing.multiplicity().sum()) <= PLAIN_MAX_GROUPS and len(seq_ids) <= PLAIN_MAX_SEQUENCES
    if kernels.COMPILED or small:
        seq_lengths, buckets = lengths[seq_ids].astype(np.float64), np.ascontiguousarray(bucket_of[seq_ids], dtype=np.int64)
        ok, flat, sizes, load = kernels.deal_groups(
            np.ascontiguousarray(seq_ids, dtype=np.int64), seq_lengths, buckets, np.lexsort((-seq_lengths, buckets)),
            costs._quad, costs._lin, costs._ring, costs._hops, np.ascontiguousarray(packing.degree_idx, dtype=np.int64),
            np.ascontiguousarray(packing.counts, dtype=np.int64), packing.multiplicity().astype(np.int64))
        assert ok, "packing counts must match the micro-batch's sequences"
        groups = Groups(flat, sizes)
    else:
        groups, load = _fill_vectorised(packing.expanded(), seq_ids, bucket_of, lengths, costs)
    return (groups, load) if with_loads else list(groups)


def _fill_vectorised(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
                     costs: DegreeCosts) -> tuple["Groups", np.ndarray]:
    """``fill_groups``'s dealing with numpy, one pass per bucket."""
    num_groups = len(packing.degree_idx)
    load = np.zeros(num_groups)
    buckets = bucket_of[seq_ids]
    by_bucket = seq_ids[np.lexsort((-lengths[seq_ids], buckets))]        # bucket, then longest first
    starts = np.searchsorted(buckets[np.argsort(buckets, kind="stable")], np.arange(packing.counts.shape[1] + 1))
    owners, members = [], []
    for b in np.unique(buckets)[::-1]:                                   # longest bucket first
        ids = by_bucket[starts[b]:starts[b + 1]]
        per_group = packing.counts[:, b]
        holders = np.flatnonzero(per_group)
        slot_group = np.repeat(holders, per_group[holders])
        first_slot = np.repeat(np.cumsum(per_group[holders]) - per_group[holders], per_group[holders])
        slot_rank = np.arange(len(slot_group)) - first_slot               # k-th sequence of its group
        slot_group = slot_group[np.lexsort((load[slot_group], slot_rank))]
        assert len(slot_group) == len(ids), "packing counts must match the micro-batch's sequences"
        load += np.bincount(slot_group, weights=costs.seconds(lengths[ids], packing.degree_idx[slot_group]),
                            minlength=num_groups)
        owners.append(slot_group)
        members.append(ids)
    owner, member = np.concatenate(owners), np.concatenate(members)
    order = np.argsort(owner, kind="stable")
    return Groups(member[order], np.bincount(owner, minlength=num_groups)), load


def rebalance(seq_ids: np.ndarray, degree_idx: np.ndarray, lengths: np.ndarray, costs: DegreeCosts) -> list[np.ndarray] | None:
    """Longest-processing-time-first over fixed group degrees on real lengths, under memory.

    Returns None when some sequence finds no group with room (the bucketed packing then stands).
    """
    num_groups = len(degree_idx)
    if len(seq_ids) * num_groups > MAX_REBALANCE_PAIRS or len(seq_ids) > MAX_REBALANCE_SEQUENCES:
        return None
    from . import kernels
    caps = np.asarray(costs.capacity, dtype=np.float64)[degree_idx]
    order = np.argsort(-lengths[seq_ids], kind="stable")
    if kernels.COMPILED or num_groups <= PLAIN_MAX_GROUPS:
        seq_lengths = lengths[seq_ids].astype(np.float64)
        ok, owner = kernels.lpt_owners(seq_lengths, order, costs.all_seconds(seq_lengths),
                                       np.ascontiguousarray(degree_idx, dtype=np.int64), caps)
        if not ok:
            return None
    else:
        owner = _lpt_vectorised(lengths[seq_ids], order, degree_idx, caps, costs)
        if owner is None:
            return None
    order = np.argsort(owner, kind="stable")
    return split_at(seq_ids[order], np.bincount(owner, minlength=num_groups))


def _lpt_vectorised(seq_lengths: np.ndarray, order: np.ndarray, degree_idx: np.ndarray, caps: np.ndarray,
                    costs: DegreeCosts) -> np.ndarray | None:
    """``rebalance``'s loop over numpy arrays of the groups: each sequence's owner, or None when one finds
    no group with room."""
    load = np.zeros(len(degree_idx))
    tokens = np.zeros(len(degree_idx))
    owner = np.empty(len(seq_lengths), dtype=np.int64)
    table = costs.all_seconds(seq_lengths)        # costed once; a row per sequence, gathered per group below
    for pos in order:
        s = float(seq_lengths[pos])
        finish = load + table[pos][degree_idx]
        finish[tokens + s > caps] = np.inf
        j = int(finish.argmin())
        if not np.isfinite(finish[j]):
            return None
        owner[pos] = j
        load[j] = finish[j]
        tokens[j] += s
    return owner


def to_members(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
               costs: DegreeCosts, rebalanced: bool = True, with_loads: bool = False):
    """``to_groups`` without building group objects: each non-empty group's ids and its degree index
    (what a caller that compares several packings needs; objects only for the one it keeps), and with
    ``with_loads`` each group's seconds (no beta1)."""
    degree_idx = np.repeat(packing.degree_idx, packing.multiplicity())     # per group (the classes stay classes)
    if len(degree_idx) == 1:                            # one group: nothing to deal or balance
        members, deg = [np.sort(seq_ids)], degree_idx[:1].copy()
        return (members, deg, group_loads(members, deg, lengths, costs)) if with_loads else (members, deg)
    best, loads = fill_groups(packing, seq_ids, bucket_of, lengths, costs, with_loads=True)
    lpt = rebalance(seq_ids, degree_idx, lengths, costs) if rebalanced else None
    if lpt is not None:
        lpt_loads = group_loads(lpt, degree_idx, lengths, costs)
        if lpt_loads.max() < loads.max():
            best, loads = lpt, lpt_loads
    if isinstance(best, Groups):
        members, used = best.nonempty()
    else:
        sizes = np.fromiter(map(len, best), dtype=np.int64, count=len(best))
        used = np.flatnonzero(sizes)
        members = best if used.size == len(best) else [best[j] for j in used.tolist()]
    return (members, degree_idx[used], loads[used]) if with_loads else (members, degree_idx[used])


def as_groups(members, degree_idx: np.ndarray, costs: DegreeCosts) -> tuple[GroupAssignment, ...]:
    """Group objects for each group's ids (a list of arrays or ``Groups``) at its degree index: built
    straight from (degree, ids) pairs, without the named tuple's keyword-handling ``__new__`` (the final
    plan of a 16,384-GPU batch has 131,072 groups)."""
    degrees = costs.degrees
    return tuple(map(assignment, zip([degrees[k] for k in np.asarray(degree_idx).tolist()], members)))



def to_groups(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
              costs: DegreeCosts, rebalanced: bool = True) -> list[GroupAssignment]:
    """Real-length groups for one micro-batch: the better of the dealt and (``rebalanced``) the
    rebalanced version."""
    return list(as_groups(*to_members(packing, seq_ids, bucket_of, lengths, costs, rebalanced), costs))
