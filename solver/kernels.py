"""The solver's inner loops, compiled: the group packer (one packing of bucket counts at one target
makespan, and its bisection), the bucketing DP, the dealing of real sequences into groups, the LPT
rebalance, ``tighten``'s steps, and three passes over a batch's sequences (their seconds at every degree,
the bucket means, each micro-batch's slowest sequence) that numpy did with temporaries or gathers.

A small batch asks for a few hundred packings (bisection steps, sweep points, local-search trials) and
a few dozen bucketings and dealings (each micro-batch refined on its own buckets); interpreted, these loops
were about half of a 64-sequence solve. Here they run on flat arrays under numba (compiled once, cached on
disk). Without numba the packer, dealing and LPT run interpreted (slower than the plain-Python loops they
replaced: 44 against 28 ms on 4 GPUs x 64 sequences), the DP and, on big micro-batches, the dealing and
LPT in their numpy forms, and ``tighten`` its numpy steps; the arithmetic is written in the same order
everywhere, so every form gives the same results (``tests/solver/test_packer.py``, ``test_bucketing.py``,
``test_materialize.py`` and ``test_tighten.py`` compare them).

The packing (see ``group_packing``): buckets longest first; each bucket picks the degree that needs the
fewest GPUs for all of it within the budget and memory (ties: smallest degree), tops up the classes
that may take it (degree at least that one, slowest first, ties in creation order; a class only part of
which takes the bucket splits off the rest), and opens new groups for what is left.
"""
from __future__ import annotations

import functools

import numpy as np

try:
    from numba import njit
except ImportError:          # numba is a dependency; a platform without its wheels runs the loops interpreted
    njit = None

COMPILED = njit is not None   # False: callers with a numpy form of a loop run that on big inputs instead


def pack_classes(counts, target, max_gpus, stretch, order, lengths, times, held, charge, degrees, capacity,
                 stretched):
    """Group classes of a packing of ``counts`` whose classes' seconds stay within ``target`` (beta1 not
    included), or ``n = -1`` when it needs more than ``max_gpus`` GPUs or a bucket fits nowhere.

    ``times[b, k]``: seconds of a bucket-``b`` sequence at degree ``k`` (inf: does not fit there);
    ``held[b, k]``: most of them one group holds (memory); ``charge[k]``: GPUs a group of degree ``k`` is
    charged when choosing a degree; ``stretched[b]``: a lone sequence's budget (``stretch``).

    Returns ``(n, degree index [n], multiplicity [n], seconds [n], counts [n, B])`` of the classes with
    at least one group, in creation order."""
    num_buckets, num_degrees = times.shape
    most = 2 * num_buckets + 2                 # a bucket adds at most two classes (a split or new groups)
    cls_k = np.zeros(most, np.int64)
    cls_mult = np.zeros(most, np.int64)
    cls_time = np.zeros(most, np.float64)
    cls_tokens = np.zeros(most, np.float64)
    cls_limit = np.zeros(most, np.float64)
    cls_counts = np.zeros((most, num_buckets), np.int64)
    ranked = np.zeros(most, np.int64)           # classes by time descending, ties in creation order
    changed = np.zeros(most, np.int64)
    merged = np.zeros(most, np.int64)
    is_changed = np.zeros(most, np.bool_)
    n = 0
    gpus = 0
    for i in range(num_buckets):
        b = order[i]
        left = counts[b]
        if left == 0:
            continue
        length = lengths[b]
        budget = target
        if stretch and stretched[b] > target:
            budget = stretched[b]
        # the degree that needs the fewest GPUs for the whole bucket (ties -> smallest degree)
        k_new, best_gpus, per_new = -1, np.inf, 0
        for k in range(num_degrees):
            t = times[b, k]
            if not np.isfinite(t):
                continue
            x = budget / t
            per = held[b, k] if x >= held[b, k] else int(x)
            if per > 0:
                needed = ((left + per - 1) // per) * charge[k]
                if needed < best_gpus:
                    k_new, best_gpus, per_new = k, needed, per
        if k_new < 0:
            return -1, cls_k, cls_mult, cls_time, cls_counts     # this bucket alone exceeds the budget everywhere
        # classes that may take this bucket, slowest first, ties in creation order: ``ranked`` holds every
        # class in that order, kept sorted as classes change (no sort per bucket)
        first_new = n
        num_changed = 0
        for j in range(first_new):
            c = ranked[j]
            k = cls_k[c]
            if k < k_new or cls_mult[c] == 0:
                continue
            t = times[b, k]
            limit = budget if budget > cls_limit[c] else cls_limit[c]
            by_time = (limit - cls_time[c]) / t
            by_memory = (capacity[k] - cls_tokens[c]) / length
            fit_f = by_time if by_time < by_memory else by_memory
            if fit_f < 1:
                continue
            fit = int(min(fit_f, 2.0 ** 52))      # no float-to-int overflow however much room a group has
            if cls_mult[c] * fit > left:          # only part of the class takes this bucket
                full = left // fit
                rest = left - full * fit
                untouched = cls_mult[c] - full - (1 if rest else 0)
                for mult, count in ((untouched, 0), (1 if rest else 0, rest)):
                    if mult:                       # detach ``mult`` groups as a class of their own
                        cls_mult[c] -= mult
                        cls_k[n], cls_mult[n], cls_limit[n] = k, mult, cls_limit[c]
                        cls_time[n] = cls_time[c] + count * t if count else cls_time[c]
                        cls_tokens[n] = cls_tokens[c] + count * length if count else cls_tokens[c]
                        cls_counts[n, :] = cls_counts[c, :]
                        cls_counts[n, b] += count
                        n += 1
                if cls_mult[c]:                    # the remaining ``full`` groups take ``fit`` each
                    cls_time[c] += fit * t
                    changed[num_changed] = c
                    num_changed += 1
                    cls_tokens[c] += fit * length
                    cls_counts[c, b] += fit
                left = 0
            else:
                cls_time[c] += fit * t
                changed[num_changed] = c
                num_changed += 1
                cls_tokens[c] += fit * length
                cls_counts[c, b] += fit
                left -= cls_mult[c] * fit
            if left <= 0:
                break
        if left > 0:
            gpus += ((left + per_new - 1) // per_new) * degrees[k_new]
            if gpus > max_gpus:
                return -1, cls_k, cls_mult, cls_time, cls_counts
            full = left // per_new
            rest = left - full * per_new
            for mult, count in ((full, per_new), (1 if rest else 0, rest)):
                if mult:
                    cls_k[n], cls_mult[n], cls_limit[n] = k_new, mult, budget
                    cls_time[n] = count * times[b, k_new]
                    cls_tokens[n] = count * length
                    cls_counts[n, b] = count
                    n += 1
        # re-rank: the classes whose time grew and the new ones, in order among themselves, merged into the rest
        for c in range(first_new, n):
            changed[num_changed] = c
            num_changed += 1
        if num_changed:
            for a in range(num_changed):
                is_changed[changed[a]] = True
            for a in range(1, num_changed):          # insertion sort: a bucket changes few classes, mostly
                c = changed[a]
                j = a
                while j > 0 and (cls_time[changed[j - 1]] < cls_time[c]
                                 or (cls_time[changed[j - 1]] == cls_time[c] and changed[j - 1] > c)):
                    changed[j] = changed[j - 1]
                    j -= 1
                changed[j] = c
            a, out = 0, 0
            for j in range(first_new):
                c = ranked[j]
                if is_changed[c]:
                    continue
                while a < num_changed and (cls_time[changed[a]] > cls_time[c]
                                           or (cls_time[changed[a]] == cls_time[c] and changed[a] < c)):
                    merged[out] = changed[a]
                    out += 1
                    a += 1
                merged[out] = c
                out += 1
            while a < num_changed:
                merged[out] = changed[a]
                out += 1
                a += 1
            for j in range(n):
                ranked[j] = merged[j]
                is_changed[ranked[j]] = False
    kept = 0
    for c in range(n):                             # drop classes whose groups all split away
        if cls_mult[c] > 0:
            cls_k[kept], cls_mult[kept], cls_time[kept] = cls_k[c], cls_mult[c], cls_time[c]
            cls_counts[kept, :] = cls_counts[c, :]
            kept += 1
    return kept, cls_k[:kept], cls_mult[:kept], cls_time[:kept], cls_counts[:kept]


def best_packing(counts, makespan, lo, rel_tol, max_iter, max_gpus, stretch, beta1, num_gpus, places,
                 order, lengths, times, held, charge, degrees, capacity, stretched):
    """The packing at ``makespan``, then bisected down towards ``lo`` (``max_iter`` steps at most, until
    within ``rel_tol``): the packing at the smallest makespan found, as ``pack_classes`` returns it, plus
    its bucketed makespan (beta1 included); ``n = -1`` when even ``makespan`` does not fit.

    ``places``: None where degrees nest (then this runs compiled); else a callable on group counts per
    degree saying whether a micro-batch gets ranks, asked while ``max_gpus <= num_gpus``
    (``best_packing.py_func`` runs then: this loop interpreted, ``pack_classes`` still compiled)."""
    got = pack_classes(counts, makespan - beta1, max_gpus, stretch, order, lengths, times, held, charge, degrees,
                       capacity, stretched)
    n, k, mult, seconds, per_class = got
    hi, found, mid = makespan, np.inf, makespan
    for step in range(max_iter + 1):
        if step:
            if hi - lo <= rel_tol * hi:
                break
            mid = 0.5 * (lo + hi)
            got = pack_classes(counts, mid - beta1, max_gpus, stretch, order, lengths, times, held, charge, degrees,
                               capacity, stretched)
        fits = got[0] >= 0 and mid > beta1     # no packing, even of nothing, finishes before beta1
        if fits and places is not None and max_gpus <= num_gpus:
            per_degree = np.zeros(len(degrees), np.int64)
            for c in range(got[0]):
                per_degree[got[1][c]] += got[2][c]
            fits = bool(places(per_degree))
        if not fits:
            if not step:
                return -1, got[1], got[2], got[3], got[4], np.inf
            lo = mid
        else:
            n, k, mult, seconds, per_class = got
            found = (seconds.max() if n else 0.0) + beta1
            hi = mid if mid < found else found
    return n, k, mult, seconds, per_class, found


def bucket_choices(cost, num_buckets):
    """The bucketing DP (``bucketing.dp_buckets``): ``choice[b, j]``, the first distinct length of the last
    bucket when ``b + 1`` buckets cover distinct lengths ``0..j`` with least padding, from ``cost[i, j]``
    (a bucket covering ``i..j``; inf below the diagonal). Ties take the smallest ``i``."""
    u = cost.shape[0]
    choice = np.zeros((num_buckets, u), np.int64)
    best = cost[0].copy()                          # one bucket covering 0..j
    new = np.empty(u, np.float64)
    for b in range(1, num_buckets):
        for j in range(u):
            # previous buckets cover 0..i-1 (nothing when i == 0), the new one covers i..j
            low, at = 0.0 + cost[0, j], 0
            for i in range(1, u):
                total = best[i - 1] + cost[i, j]
                if total < low:
                    low, at = total, i
            choice[b, j], new[j] = at, low
        best[:] = new
    return choice


def bucket_choices_vectorised(cost, num_buckets):
    """``bucket_choices`` with numpy, one step per bucket (what runs without numba: the triple loop
    interpreted would take seconds on a thousand candidates); the same choices bit for bit."""
    best = cost[0].copy()
    choice = np.zeros((num_buckets, cost.shape[0]), dtype=np.int64)
    for b in range(1, num_buckets):
        total = np.concatenate([[0.0], best[:-1]])[:, None] + cost
        choice[b] = total.argmin(axis=0)
        best = total.min(axis=0)
    return choice


def lpt_owners(seq_lengths, order, table, degree_idx, caps):
    """``materialize.rebalance``'s longest-first loop: each sequence (in ``order``) to the group that
    would finish it first (``table[pos, k]``: its seconds at degree index ``k``) among those with room
    (``caps``: tokens per group); ties to the lowest group. ``(False, ...)`` when one finds no room."""
    num_groups = degree_idx.shape[0]
    load = np.zeros(num_groups, np.float64)
    tokens = np.zeros(num_groups, np.float64)
    owner = np.zeros(seq_lengths.shape[0], np.int64)
    for pos in order:
        s = seq_lengths[pos]
        best, finish = -1, np.inf
        for j in range(num_groups):
            if tokens[j] + s > caps[j]:
                continue
            f = load[j] + table[pos, degree_idx[j]]
            if f < finish:                  # strict: the first least finish
                best, finish = j, f
        if best < 0:
            return False, owner
        owner[pos] = best
        load[best] = finish
        tokens[best] += s
    return True, owner


def seconds_table(lengths, quad, lin, ring, hops, capacity, degrees):
    """Every sequence at every degree in one pass: ``[n, D]`` seconds memory aside (``DegreeCosts.all_seconds``),
    and each sequence's least seconds and least GPU-seconds among the degrees whose memory holds it (``inf``
    rows of ``DegreeCosts.times`` skipped). The formula as ``seconds_at`` (numpy's, element for element); the
    numpy form took 70 ms of temporaries on 131,072 sequences x 15 degrees, this about 5."""
    n, num_degrees = lengths.shape[0], quad.shape[0]
    out = np.empty((n, num_degrees), np.float64)
    least_time = np.full(n, np.inf)
    least_area = np.full(n, np.inf)
    for i in range(n):
        x = lengths[i]
        for k in range(num_degrees):
            t = seconds_at(x, k, quad, lin, ring, hops)
            out[i, k] = t
            if x > capacity[k]:
                continue
            if t < least_time[i]:
                least_time[i] = t
            area = t * degrees[k]
            if area < least_area[i]:
                least_area[i] = area
    return out, least_time, least_area


def group_max(owner, values, num_groups):
    """``[num_groups]`` largest of ``values[i]`` over the ``i`` with ``owner[i] == g`` (0.0 where none): what
    ``np.maximum.at`` gives, which took 8-13 ms on 131,072 sequences inside a solve (0.4 ms alone)."""
    out = np.zeros(num_groups, np.float64)
    for i in range(owner.shape[0]):
        if values[i] > out[owner[i]]:
            out[owner[i]] = values[i]
    return out


def bucket_sums(per_seq, ids, index, num_buckets):
    """``[num_buckets, D]`` sums of ``per_seq[ids[j], k]`` over the ``j`` with ``index[j] == b``, added in ``j``'s
    order (``np.bincount``'s order, so the sums are its bit for bit), reading each sequence's row in place: a
    micro-batch's ids come in group order, and 15 gathers of its 97,000 seconds (one per degree) cost 7 ms where
    one pass over rows costs 3."""
    num_degrees = per_seq.shape[1]
    out = np.zeros((num_buckets, num_degrees), np.float64)
    for j in range(ids.shape[0]):
        b, i = index[j], ids[j]
        for k in range(num_degrees):
            out[b, k] += per_seq[i, k]
    return out


def seconds_at(x, d, quad, lin, ring, hops):
    """Seconds of a sequence of ``x`` tokens at degree index ``d``: ``solver.types.seconds``' formula, the
    same operations in the same order (so the kernels' sums match numpy's element for element)."""
    return lin[d] * x + max(quad[d] * x * x, ring[d] * x + hops[d])


def deal_groups(ids, seq_lengths, buckets, perm, quad, lin, ring, hops, class_degree, class_counts, class_mult):
    """``materialize.fill_groups``'s dealing: each bucket's sequences (longest bucket first; within one,
    longest first, ties in input order) dealt to the slots of the groups holding it, the k-th slot of every
    group before any (k+1)-th, least loaded group first (ties: lower group); a sequence of length ``x``
    costs ``lin*x + max(quad*x^2, ring*x + hops)`` at its group's degree. The groups come as the packer's
    classes: ``class_mult[c]`` groups of degree index ``class_degree[c]`` holding ``class_counts[c, b]``
    sequences of bucket ``b`` each, numbered class by class (``BinPacking.expanded``'s order). Returns
    ``(ok, ids grouped by group, group sizes, group seconds)``; ``ok`` False when the counts do not match
    the sequences. ``perm``: the positions by bucket, then longest first, then input order (numpy's
    ``lexsort((-seq_lengths, buckets))``, faster than a compiled sort). O(n + buckets x classes + the groups
    holding each bucket, log of them): a bucket's groups are sorted by load once, not its slots, and the
    classes are not expanded into a [groups, buckets] table (11,000 groups x 340 buckets in a refined
    micro-batch)."""
    n = ids.shape[0]
    num_classes = class_counts.shape[0]
    first = np.zeros(num_classes + 1, np.int64)     # each class's first group
    for c in range(num_classes):
        first[c + 1] = first[c] + class_mult[c]
    num_groups = first[num_classes]
    group_class = np.empty(num_groups, np.int64)
    for c in range(num_classes):
        group_class[first[c]:first[c + 1]] = c
    load = np.zeros(num_groups, np.float64)
    added = np.zeros(num_groups, np.float64)
    owner = np.zeros(n, np.int64)                  # group of the t-th sequence dealt
    dealt = np.zeros(n, np.int64)
    holders = np.zeros(num_groups, np.int64)
    t, end = 0, n
    while end > 0:                                 # perm ascends by bucket: the longest bucket is last
        b = buckets[perm[end - 1]]
        start = end - 1
        while start > 0 and buckets[perm[start - 1]] == b:
            start -= 1
        total, num_holders = 0, 0
        for c in range(num_classes):
            if class_counts[c, b] > 0:
                total += class_counts[c, b] * class_mult[c]
                for g in range(first[c], first[c + 1]):
                    holders[num_holders] = g
                    num_holders += 1
        if total != end - start:
            return False, dealt, np.zeros(num_groups, np.int64), load
        holding = num_holders                      # ``holders[:holding]`` stays as is: ``active`` is a copy
        active = holders[:num_holders][np.argsort(load[holders[:num_holders]], kind="mergesort")]
        rank, i = 0, start
        while num_holders > 0:                     # the rank-th slot of each group still holding one
            kept = 0
            for a in range(num_holders):
                g = active[a]
                pos = perm[i]
                i += 1
                x, d = seq_lengths[pos], class_degree[group_class[g]]
                added[g] += seconds_at(x, d, quad, lin, ring, hops)
                owner[t], dealt[t] = g, ids[pos]
                t += 1
                if class_counts[group_class[g], b] > rank + 1:
                    active[kept] = g
                    kept += 1
            num_holders = kept
            rank += 1
        for g in holders[:holding]:                # the other groups' loads stay (adding 0.0 changes nothing)
            load[g] = load[g] + added[g]
            added[g] = 0.0
        end = start
    sizes = np.zeros(num_groups, np.int64)
    for i in range(n):
        sizes[owner[i]] += 1
    at = np.zeros(num_groups, np.int64)           # each group's ids in dealing order: a counting sort
    for g in range(1, num_groups):
        at[g] = at[g - 1] + sizes[g - 1]
    grouped = np.zeros(n, np.int64)
    for i in range(n):
        grouped[at[owner[i]]] = dealt[i]
        at[owner[i]] += 1
    return True, grouped, sizes, load


def tighten_groups(flat, sizes, deg, loads, flat_lengths, quad, lin, ring, hops, degrees, capacity, num_gpus,
                   max_steps, max_candidates):
    """``tighten.tighten_members``' steps where degrees nest: each step takes the slowest group and
    promotes it (free GPUs), merges it with the fastest group of its degree, or moves one of its
    ``max_candidates`` longest sequences to the group that would finish earliest with it, whichever ends
    lowest below the slowest load; it stops when none helps or more groups tie at the top than the steps
    left could take off. Groups are linked lists over ``flat``'s positions (a move or merge relinks a few);
    ``flat_lengths[p]`` is the length of sequence ``flat[p]``; a group may start empty. Sums run in order, as
    the numpy steps take them. A step is O(groups): 256 steps of 16,384 groups take about 50 ms.

    Returns the live groups' ids (each group's ascending), sizes, degree indices and seconds."""
    num_groups, n, num_degrees = sizes.shape[0], flat.shape[0], degrees.shape[0]
    head = np.full(num_groups, -1, np.int64)
    tail = np.full(num_groups, -1, np.int64)
    after_pos = np.full(n, -1, np.int64)
    before_pos = np.full(n, -1, np.int64)
    count = sizes.copy()
    deg = deg.copy()
    loads = loads.copy()
    alive = np.ones(num_groups, np.bool_)
    tokens = np.zeros(num_groups, np.float64)
    free = num_gpus
    start = 0
    for g in range(num_groups):
        for i in range(sizes[g]):
            p = start + i
            tokens[g] += flat_lengths[p]
            if i:
                after_pos[p - 1], before_pos[p] = p, p - 1
        if sizes[g]:
            head[g], tail[g] = start, start + sizes[g] - 1
        start += sizes[g]
        free -= degrees[deg[g]]
    live = num_groups
    least = np.zeros(num_degrees, np.float64)
    for step in range(max_steps):
        s = 0
        for g in range(1, num_groups):               # a dead group's load is -inf
            if loads[g] > loads[s]:
                s = g
        worst = loads[s] * (1 - 1e-9)
        tied = 0
        for g in range(num_groups):
            if loads[g] >= worst:
                tied += 1
        if tied > 2 * (max_steps - step):
            break
        k = deg[s]
        best, action, other, moved = np.inf, 0, -1, -1    # action: 1 promote, 2 merge, 3 move
        if k + 1 < num_degrees and free >= degrees[k + 1] - degrees[k]:
            t, p = 0.0, head[s]
            while p >= 0:
                x = float(flat_lengths[p])
                t += seconds_at(x, k + 1, quad, lin, ring, hops)
                p = after_pos[p]
            if t < worst:
                best, action = t, 1
        if k + 1 < num_degrees and degrees[k + 1] == 2 * degrees[k]:
            h = -1
            for g in range(num_groups):
                if deg[g] == k and alive[g] and g != s and (h < 0 or loads[g] < loads[h]):
                    h = g
            if h >= 0:
                t = 0.0
                for g in (s, h):
                    p = head[g]
                    while p >= 0:
                        x = float(flat_lengths[p])
                        t += seconds_at(x, k + 1, quad, lin, ring, hops)
                        p = after_pos[p]
                if t < worst and t < best:
                    best, action, other = t, 2, h
        if live > 1 and count[s] > 1:
            mine = np.empty(count[s], np.int64)
            p, i = head[s], 0
            while p >= 0:
                mine[i], p, i = p, after_pos[p], i + 1
            mine_lengths = np.empty(count[s], np.float64)
            for i in range(count[s]):
                mine_lengths[i] = -float(flat_lengths[mine[i]])
            candidates = mine[np.argsort(mine_lengths, kind="mergesort")[:max_candidates]]
            shortest = np.inf
            for c in candidates:
                shortest = min(shortest, float(flat_lengths[c]))
            for d in range(num_degrees):
                least[d] = seconds_at(shortest, d, quad, lin, ring, hops)
            # only groups that could take the shortest candidate and still end before the slowest one did
            # can be a destination: usually a few, as packed groups end close to the makespan
            dest = np.empty(num_groups, np.int64)
            num_dest = 0
            for j in range(num_groups):
                if alive[j] and j != s and loads[j] + least[deg[j]] < worst:
                    dest[num_dest] = j
                    num_dest += 1
            score_best, pick_c, pick_j = np.inf, -1, -1
            for c in candidates:
                x = float(flat_lengths[c])
                left = loads[s] - seconds_at(x, k, quad, lin, ring, hops)
                for i in range(num_dest):
                    j = dest[i]
                    d = deg[j]
                    finish = loads[j] + seconds_at(x, d, quad, lin, ring, hops)
                    if not tokens[j] + x <= capacity[d]:
                        finish = np.inf
                    score = finish if finish > left else left
                    if score < score_best:
                        score_best, pick_c, pick_j = score, c, j
            if pick_c >= 0 and score_best < worst and score_best < best:
                best, action, other, moved = score_best, 3, pick_j, pick_c
        if action == 0:
            break
        if action == 1:
            free -= degrees[k + 1] - degrees[k]
            deg[s], loads[s] = k + 1, best
        elif action == 2:
            if head[other] >= 0:                   # the merged group's sequences follow the slowest group's
                if tail[s] >= 0:
                    after_pos[tail[s]], before_pos[head[other]] = head[other], tail[s]
                else:
                    head[s] = head[other]
                tail[s], count[s] = tail[other], count[s] + count[other]
            head[other], tail[other], count[other] = -1, -1, 0
            deg[s], loads[s], tokens[s] = k + 1, best, tokens[s] + tokens[other]
            alive[other], loads[other] = False, -np.inf       # same GPUs: 2 x degree k = degree k + 1
            live -= 1
        else:
            p = moved                                  # unlink from s, append to the destination
            if before_pos[p] >= 0:
                after_pos[before_pos[p]] = after_pos[p]
            else:
                head[s] = after_pos[p]
            if after_pos[p] >= 0:
                before_pos[after_pos[p]] = before_pos[p]
            else:
                tail[s] = before_pos[p]
            before_pos[p], after_pos[p] = tail[other], -1
            if tail[other] >= 0:
                after_pos[tail[other]] = p
            else:                                  # an empty destination
                head[other] = p
            tail[other] = p
            count[s] -= 1
            count[other] += 1
            x = float(flat_lengths[p])
            d, e = deg[s], deg[other]
            loads[s] -= seconds_at(x, d, quad, lin, ring, hops)
            loads[other] += seconds_at(x, e, quad, lin, ring, hops)
            tokens[s] -= x
            tokens[other] += x
    kept = 0
    for g in range(num_groups):
        if alive[g] and count[g] > 0:
            kept += 1
    out_ids = np.empty(n, np.int64)
    out_sizes = np.empty(kept, np.int64)
    out_deg = np.empty(kept, np.int64)
    out_loads = np.empty(kept, np.float64)
    i, q = 0, 0
    for g in range(num_groups):
        if not alive[g] or count[g] == 0:
            continue
        first, p = i, head[g]
        while p >= 0:
            out_ids[i], p, i = flat[p], after_pos[p], i + 1
        out_ids[first:i] = np.sort(out_ids[first:i])
        out_sizes[q], out_deg[q], out_loads[q] = i - first, deg[g], loads[g]
        q += 1
    return out_ids, out_sizes, out_deg, out_loads


def _compiled(function):
    """``function`` compiled by numba, cached on disk (next to this file, else in the user's cache directory);
    compiled afresh in each process where neither can be written (numba refuses to cache then)."""
    try:
        return njit(cache=True, nogil=True)(function)
    except RuntimeError:                  # "cannot cache function ...: no locator available"
        return njit(nogil=True)(function)


best_packing_interpreted = best_packing      # the loop interpreted (a ``places`` callable), its packings compiled
if njit is not None:
    pack_classes = _compiled(pack_classes)
    best_packing = _compiled(best_packing)
    bucket_choices = _compiled(bucket_choices)
    lpt_owners = _compiled(lpt_owners)
    bucket_sums = _compiled(bucket_sums)
    group_max = _compiled(group_max)
    seconds_at = _compiled(seconds_at)       # before the kernels calling it compile (at their first call)
    seconds_table = _compiled(seconds_table)
    deal_groups = _compiled(deal_groups)
    tighten_groups = _compiled(tighten_groups)
else:
    bucket_choices = bucket_choices_vectorised


@functools.cache
def warm() -> None:
    """Compile the kernels now (or load them from numba's cache on disk), outside any time limit: the first
    packing of a process pays it otherwise (6-10 s to compile on a 2-core machine, once; 0.3-0.7 s to load).
    ``flexsp.plan_batch`` calls it before its clock starts; once a process (later calls return at once)."""
    ints, floats = np.ones(1, np.int64), np.ones(1, np.float64)
    best_packing(ints, np.inf, 0.0, 1e-3, 1, 1.0, False, 0.0, 1, None,
                 np.zeros(1, np.int64), floats, np.ones((1, 1)), np.ones((1, 1), np.int64), floats, ints, floats, floats)
    pack_classes(ints, 1.0, 1.0, False, np.zeros(1, np.int64), floats, np.ones((1, 1)), np.ones((1, 1), np.int64),
                 floats, ints, floats, floats)      # also called alone, by the interpreted bisection (placement)
    bucket_choices(np.ones((2, 2)), 2)
    lpt_owners(floats, ints - 1, np.ones((1, 1)), ints - 1, floats)
    bucket_sums(np.ones((1, 1)), ints - 1, ints - 1, 1)
    group_max(ints - 1, floats, 1)
    seconds_table(floats, floats, floats, floats, floats, floats, floats)
    deal_groups(ints, floats, ints - 1, ints - 1, floats, floats, floats, floats, ints - 1, np.ones((1, 1), np.int64),
                ints)
    tighten_groups(ints - 1, ints, ints - 1, floats, floats, floats, floats, floats, floats, ints, floats, 1, 1, 1)
