"""Turn bucket-count groups back into real sequences, then rebalance on the real lengths."""
from __future__ import annotations

import numpy as np

from .costs import DegreeCosts
from .packing import BinPacking
from .schedule import GroupAssignment

# LPT rebalancing costs O(sequences x groups); skip it above this many pairs.
MAX_REBALANCE_PAIRS = 4_000_000


def fill_groups(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
                costs: DegreeCosts) -> list[np.ndarray]:
    """Deal each bucket's real sequences (longest first) round-robin over the groups that hold it,
    least-loaded group first, so the rounding-up of bucketing is spread evenly."""
    num_groups = len(packing.degree_idx)
    members: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
    load = np.zeros(num_groups)
    ids_by_bucket = {}
    bucket_ids = bucket_of[seq_ids]
    for b in np.unique(bucket_ids):
        ids = seq_ids[bucket_ids == b]
        ids_by_bucket[b] = ids[np.argsort(-lengths[ids], kind="stable")]
    for b in sorted(ids_by_bucket, key=lambda b: -lengths[ids_by_bucket[b][0]]):
        ids = ids_by_bucket[b]
        per_group = packing.counts[:, b]
        holders = np.flatnonzero(per_group)
        slot_group = np.repeat(holders, per_group[holders])
        slot_rank = np.concatenate([np.arange(c) for c in per_group[holders]])
        slot_order = np.lexsort((load[slot_group], slot_rank))
        slot_group = slot_group[slot_order]
        assert len(slot_group) == len(ids), "packing counts must match the micro-batch's sequences"
        for j in holders:
            mine = ids[slot_group == j]
            members[j].append(mine)
            load[j] += costs.seq_time(lengths[mine], int(packing.degree_idx[j])).sum()
    return [np.concatenate(m) if m else np.empty(0, dtype=np.int64) for m in members]


def group_loads(groups: list[np.ndarray], degree_idx: np.ndarray, lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    return np.array([costs.seq_time(lengths[g], int(k)).sum() for g, k in zip(groups, degree_idx)])


def rebalance(seq_ids: np.ndarray, degree_idx: np.ndarray, lengths: np.ndarray, costs: DegreeCosts) -> list[np.ndarray] | None:
    """Longest-processing-time-first over fixed group degrees on real lengths, under memory.

    Returns None when some sequence finds no group with room (the bucketed packing then stands).
    """
    num_groups = len(degree_idx)
    if len(seq_ids) * num_groups > MAX_REBALANCE_PAIRS:
        return None
    caps = np.asarray(costs.capacity)[degree_idx]
    quad = np.asarray(costs.quad)[degree_idx]
    lin = np.asarray(costs.lin)[degree_idx]
    load = np.zeros(num_groups)
    tokens = np.zeros(num_groups)
    owner = np.empty(len(seq_ids), dtype=np.int64)
    order = np.argsort(-lengths[seq_ids], kind="stable")
    for pos in order:
        s = float(lengths[seq_ids[pos]])
        finish = load + quad * s * s + lin * s
        finish[tokens + s > caps] = np.inf
        j = int(finish.argmin())
        if not np.isfinite(finish[j]):
            return None
        owner[pos] = j
        load[j] = finish[j]
        tokens[j] += s
    return [seq_ids[owner == j] for j in range(num_groups)]


def to_groups(packing: BinPacking, seq_ids: np.ndarray, bucket_of: np.ndarray, lengths: np.ndarray,
              costs: DegreeCosts) -> list[GroupAssignment]:
    """Real-length groups for one micro-batch: the better of the dealt and the rebalanced version."""
    dealt = fill_groups(packing, seq_ids, bucket_of, lengths, costs)
    best = dealt
    lpt = rebalance(seq_ids, packing.degree_idx, lengths, costs)
    if lpt is not None:
        dealt_max = group_loads(dealt, packing.degree_idx, lengths, costs).max()
        if group_loads(lpt, packing.degree_idx, lengths, costs).max() < dealt_max:
            best = lpt
    return [GroupAssignment(int(costs.degrees[k]), np.sort(g))
            for g, k in zip(best, packing.degree_idx) if len(g)]
