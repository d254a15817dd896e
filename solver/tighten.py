"""Lower one micro-batch's makespan by working on its slowest group, on real lengths.

The packer bisects a makespan on bucketed estimates; once real sequences are placed, a few groups
(often one long sequence alone in a small group) run past the rest while most GPUs idle. Each step
takes the slowest group and tries, costed for every group at once (compiled, ``kernels.tighten_groups``, where
degrees nest; with numpy otherwise):

* **promote** it to the next larger degree when the micro-batch has that many GPUs free;
* **merge** it with the fastest group of its degree into one group of twice the degree (same GPUs,
  both groups' sequences: the long sequence now runs on twice the GPUs);
* **move** one of its sequences to the group that would finish earliest with it and has memory.

A step is kept only when every group it changes ends faster than the slowest group did, so the
makespan never rises (and, for degrees whose tiles do not nest, only when the micro-batch still gets
ranks: ``DegreeCosts.placeable``); it stops when the slowest group cannot be helped, when more groups
tie at the slowest load than the steps left could relieve, or at the deadline.
"""
from __future__ import annotations

import time

import numpy as np

from .materialize import as_groups
from .types import DegreeCosts, GroupAssignment, Groups, flat_ids, group_loads, group_sizes

MAX_STEPS = 256             # steps per micro-batch (each O(groups x moved candidates))
MAX_MOVE_CANDIDATES = 16    # longest sequences of the slowest group considered for a move


def in_order(seconds: np.ndarray) -> float:
    """The sum taken element by element, as the compiled steps take it (numpy's ``sum`` pairs them up: near
    ties could then pick another step with numba than without)."""
    return float(np.cumsum(seconds)[-1]) if len(seconds) else 0.0


def tighten(groups: tuple[GroupAssignment, ...], lengths: np.ndarray, costs: DegreeCosts, num_gpus: int,
            deadline: float | None = None) -> tuple[GroupAssignment, ...]:
    """The micro-batch with its slowest groups promoted, merged or relieved while that helps."""
    index = {d: k for k, d in enumerate(costs.degrees)}
    members = [np.asarray(g.seq_ids) for g in groups]
    deg = np.array([index[g.degree] for g in groups], dtype=np.int64)
    return as_groups(*tighten_members(members, deg, lengths, costs, num_gpus, deadline), costs)


def tighten_members(members, deg: np.ndarray, lengths: np.ndarray, costs: DegreeCosts,
                    num_gpus: int, deadline: float | None = None,
                    loads: np.ndarray | None = None, with_loads: bool = False):
    """``tighten`` on each group's ids (a list of arrays or ``Groups``) and degree index (``loads``: their
    seconds, if known); returns the new ids as ``Groups`` (each group's sorted) and degree indices (and,
    ``with_loads``, their seconds).

    Where degrees nest and numba is installed the steps run compiled (``kernels.tighten_groups``: the same
    steps and sums; the deadline is checked before them only, as all 256 take about 50 ms at 16,384 groups).
    Otherwise the groups stay one flat array: a step reads the few groups it changes as slices and keeps their new
    ids apart (``changed``), and a merged-away group is marked dead instead of deleted, so a micro-batch
    of thousands of groups is never split into thousands of arrays."""
    from . import kernels
    if kernels.COMPILED and costs.placeable is None and (deadline is None or time.perf_counter() <= deadline):
        return _tighten_compiled(members, deg, lengths, costs, num_gpus, loads, with_loads)
    flat, sizes = flat_ids(members), group_sizes(members)
    starts = np.cumsum(sizes) - sizes
    changed: dict[int, np.ndarray] = {}

    def ids(j: int) -> np.ndarray:
        got = changed.get(j)
        return flat[starts[j]:starts[j] + sizes[j]] if got is None else got

    deg = np.array(deg, dtype=np.int64)
    alive = np.ones(len(sizes), dtype=bool)
    degrees = np.asarray(costs.degrees)
    capacity = np.asarray(costs.capacity)
    loads = group_loads(members, deg, lengths, costs) if loads is None else np.array(loads, dtype=np.float64)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    tokens = np.bincount(owner, weights=lengths[flat].astype(np.float64), minlength=len(sizes))
    free = num_gpus - int(degrees[deg].sum())                  # kept up to date below: a step changes a group or two
    live = len(sizes)
    # degrees whose tiles do not nest: a promote or merge must leave group counts that still get ranks
    per_degree = np.bincount(deg, minlength=len(degrees)) if costs.placeable is not None else None

    def places(k: int, removed: int) -> bool:
        """Whether the micro-batch places with ``removed`` groups of degree index ``k`` made one of ``k + 1``."""
        if per_degree is None:
            return True
        trial = per_degree.copy()
        trial[k] -= removed
        trial[k + 1] += 1
        return costs.places(trial)
    for step in range(MAX_STEPS):
        if deadline is not None and time.perf_counter() > deadline:
            break
        s = int(loads.argmax())                                # a dead group's load is -inf
        worst = loads[s] * (1 - 1e-9)
        # A step takes at most two groups (a merge) off the slowest load; when more groups tie at it
        # than the steps left can take off, the makespan cannot drop: stop (same makespan, less work)
        if int(np.count_nonzero(loads >= worst)) > 2 * (MAX_STEPS - step):
            break
        best = None                                            # (new max of changed groups, action)
        k = deg[s]
        mine = ids(s)
        if k + 1 < len(degrees) and free >= degrees[k + 1] - degrees[k]:
            t = in_order(costs.seconds(lengths[mine], k + 1))
            if t < worst and places(k, 1):
                best = (t, ("promote", s))
        if k + 1 < len(degrees) and degrees[k + 1] == 2 * degrees[k]:
            same = np.flatnonzero((deg == k) & alive)
            same = same[same != s]
            if same.size:
                h = int(same[loads[same].argmin()])
                t = in_order(costs.seconds(lengths[np.concatenate([mine, ids(h)])], k + 1))
                if t < worst and (best is None or t < best[0]) and places(k, 2):
                    best = (t, ("merge", s, h))
        if live > 1 and len(mine) > 1:
            cand = mine[np.argsort(-lengths[mine], kind="stable")[:MAX_MOVE_CANDIDATES]]
            # only groups that could take the shortest candidate and still end before the slowest
            # one did can be a destination (the rest score >= worst): usually a few, as packed
            # groups end close to the makespan, so the [C, G] scores shrink to [C, few]
            least = costs.seconds(np.full(len(degrees), float(lengths[cand].min())), np.arange(len(degrees)))
            dest = np.flatnonzero((loads + least[deg] < worst) & alive)
            dest = dest[dest != s]
            if dest.size:
                add = costs.seconds(lengths[cand][:, None].astype(np.float64), deg[dest][None, :])   # [C, dest]
                after = loads[dest][None, :] + add
                room = tokens[dest][None, :] + lengths[cand][:, None] <= capacity[deg[dest]][None, :]
                after[~room] = np.inf
                left = loads[s] - costs.seconds(lengths[cand].astype(np.float64), k)           # [C]
                score = np.maximum(after, left[:, None])
                c, j = np.unravel_index(int(score.argmin()), score.shape)
                if score[c, j] < worst and (best is None or score[c, j] < best[0]):
                    best = (float(score[c, j]), ("move", s, int(dest[j]), int(cand[c])))
        if best is None:
            break
        action = best[1]
        if action[0] in ("promote", "merge") and per_degree is not None:
            per_degree[k] -= 1 if action[0] == "promote" else 2
            per_degree[k + 1] += 1
        if action[0] == "promote":
            free -= int(degrees[k + 1] - degrees[k])
            deg[s] = k + 1
            loads[s] = best[0]
        elif action[0] == "merge":
            h = action[2]
            changed[s] = np.concatenate([mine, ids(h)])
            deg[s], loads[s], tokens[s] = k + 1, best[0], tokens[s] + tokens[h]
            alive[h], loads[h] = False, -np.inf                 # same GPUs: 2 x degree k = degree k + 1
            live -= 1
        else:
            _, s, j, seq = action
            changed[s] = mine[mine != seq]
            changed[j] = np.append(ids(j), seq)
            length = float(lengths[seq])
            loads[s] -= float(costs.seconds(length, deg[s]))
            loads[j] += float(costs.seconds(length, deg[j]))
            tokens[s] -= length
            tokens[j] += length
    # every live group's ids sorted in one vectorised pass (a sort per group costs more with thousands):
    # one sort of group x batch size + id, a single int64 key (cheaper than a two-key lexsort)
    kept = alive.copy()
    kept[list(changed)] = False                               # groups whose ids are the input's slice
    touched = [j for j in changed if alive[j]]
    new_ids = np.concatenate([flat[kept[owner]], *(changed[j] for j in touched)])
    new_owner = np.concatenate([owner[kept[owner]], *(np.full(len(changed[j]), j) for j in touched)])
    span = len(lengths)
    position = np.cumsum(alive) - 1                            # a live group's index among the live ones
    key = position[new_owner] * span + new_ids
    key.sort()
    new_sizes = np.bincount(position[new_owner], minlength=int(alive.sum()))
    keep = new_sizes > 0
    out = Groups(key % span, new_sizes[keep]), deg[alive][keep]
    return (*out, loads[alive][keep]) if with_loads else out


def _tighten_compiled(members, deg: np.ndarray, lengths: np.ndarray, costs: DegreeCosts, num_gpus: int,
                      loads: np.ndarray | None, with_loads: bool):
    """``tighten_members`` by ``kernels.tighten_groups`` (degrees that nest)."""
    from . import kernels
    loads = group_loads(members, deg, lengths, costs) if loads is None else np.array(loads, dtype=np.float64)
    flat = np.ascontiguousarray(flat_ids(members), dtype=np.int64)
    ids, sizes, deg, loads = kernels.tighten_groups(
        flat, np.ascontiguousarray(group_sizes(members), dtype=np.int64), np.ascontiguousarray(deg, dtype=np.int64),
        loads, np.asarray(lengths)[flat].astype(np.float64),     # a fresh array: never a read-only caller's
        costs._quad, costs._lin, costs._ring, costs._hops, np.asarray(costs.degrees, dtype=np.int64),
        np.asarray(costs.capacity, dtype=np.float64), int(num_gpus), MAX_STEPS, MAX_MOVE_CANDIDATES)
    out = Groups(ids, sizes), deg
    return (*out, loads) if with_loads else out
