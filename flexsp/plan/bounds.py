"""Lower bounds on any plan's step time, to say how far a plan is from optimal.

``lower_bound`` is the simple one: every sequence at its cheapest degree spread over all GPUs, plus
``beta1`` per micro-batch memory needs. It ignores that a long sequence must run at a large,
area-expensive degree to finish within its micro-batch, and that memory caps how much work each
micro-batch can take, so a gap to it may be the bound's, not the plan's.

``coupled_lower_bound`` couples the three. Sort any plan's micro-batches by makespan; ``tau_j``
(the ``j``-th largest, minus ``beta1``) is at most ``(S - w_j) / j``, where ``S`` is the sum of all of
them and ``w_j`` the least time the micro-batches after the ``j``-th need for the tokens the first ``j``
cannot hold (``_forced_work``; 0 where they hold everything). A sequence in micro-batch ``j`` must use a
degree that finishes it within that and holds it, so its GPU-seconds are at least ``a(s, (S - w_j) / j)``,
the least area over such degrees. Each micro-batch holds at most ``N x capacity`` tokens and at most
``N tau_j`` GPU-seconds, and all of them at most ``N S``. The smallest ``S`` for which a fractional
assignment of tokens to micro-batch ranks meets all of that (a small LP over length buckets, each
costed at its shortest length) plus ``M beta1``, minimised over the micro-batch count ``M``, is a bound
no plan can beat, and never below the simple one. Counts up to a few above the memory bound get one LP
each; all larger counts share one LP whose last rank pools every rank beyond (no memory limit there), so
the minimum is over every count.

The LP pools memory and GPU-seconds over the whole micro-batch, so it lets short sequences use the
memory of GPUs that a long sequence's group keeps busy. ``_split_spans`` (issue 27) closes that for
the longest sequences: in a plan of ``m`` micro-batches, memory forces some tokens into the long
sequence's micro-batch; on its group's GPUs they lengthen that group, on the other GPUs they fit
only ``(N - d) x capacity`` tokens and so carry little compute. Count by count the coupled bound
takes the larger of the LP's span and that one; both hold for every plan, so the larger does too.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel, TermCosts
from flexsp.plan.lengths import as_lengths
from solver.bucketing import dp_buckets
from solver.types import DegreeCosts

# Length buckets of the LP (each costed at its shortest member: a relaxation, so still a bound),
# and how many of the longest sequences get a bucket of their own (they set the critical path).
# 128 rather than 32: at 16,384 GPUs (gpt-7b constants, 131,072 sequences) a bucket of the long tail
# costed at its shortest member hid 1.0% of the step (plan / bound 1.075 -> 1.065) for 0.15 s more CPU;
# on the paper setting (512 sequences, 64 GPUs) it changes no bound and costs nothing measurable.
BOUND_BUCKETS = 128
OWN_BUCKETS = 8
# Micro-batch counts above the memory bound that are tried one LP each; counts beyond fall back
# to the simple quantities (valid for any count).
EXTRA_COUNTS = 8
# The LP is solved to floating-point tolerances; shave this much so rounding never lifts the
# bound above a plan.
SAFETY = 1e-6


def _degree_costs(cost: CostModel, cluster: Cluster, max_degree: int | None, degrees,
                  lengths: np.ndarray) -> DegreeCosts:
    """Costs of the degrees a plan may use: ``degrees`` (a set, ``"any"`` or None for the powers of two).
    Bounds ignore where groups sit (tiles), a relaxation, so they hold for non-nesting sets too. A batch
    no plan can hold (a sequence longer than the largest degree holds) is refused with ``plan_batch``'s
    ``PlanError``: it has no finite bound, and its infinite areas would turn the LP's sums into NaN."""
    from flexsp.plan.config import PlanConfig
    from flexsp.plan.planner import check_held  # the planner imports the strategies: only when asked
    # the degrees plan_batch would use ("any" resolved; a model without a ring axis: none past its heads)
    degrees = PlanConfig(degrees=degrees, max_degree=max_degree).checked(cost, cluster).degrees
    costs = cost.degree_costs(cluster.usable_degrees(max_degree, degrees))
    check_held(lengths, cost, cluster, costs.degrees[-1])
    return costs


def lower_bound(lengths, cost: CostModel, cluster: Cluster, max_degree: int | None = None,
                degrees=None) -> float:
    """Every sequence at its cheapest degree (GPU-seconds) spread perfectly over all GPUs, plus
    beta1 for each of the fewest micro-batches whose memory could hold the batch."""
    lengths = as_lengths(lengths).astype(np.float64)
    costs = _degree_costs(cost, cluster, max_degree, degrees, lengths)
    area = (costs.times(lengths) * np.asarray(costs.degrees)[None, :]).min(axis=1)
    micro_batches = max(1, math.ceil(lengths.sum() / (cost.token_capacity * cluster.num_gpus) - 1e-12))
    return float(area.sum()) / cluster.num_gpus + cost.beta1 * micro_batches


def coupled_lower_bound(lengths, cost: CostModel, cluster: Cluster, max_degree: int | None = None,
                        degrees=None, memory_split: bool = True) -> float:
    """The LP bound of the module docstring: never above any plan's time, never below
    ``lower_bound`` (nor below the slowest sequence at its fastest degree plus the micro-batches'
    beta1). ``memory_split`` (default) also takes, count by count, the larger of the LP's span and
    ``_split_spans`` (memory caps what the longest sequence's micro-batch can compute); False gives
    the LP bound alone (issue 27's baseline)."""
    return coupled_by_count(lengths, cost, cluster, max_degree, degrees, memory_split).least * (1 - SAFETY)


@dataclasses.dataclass
class CountBounds:
    """``coupled_by_count``'s answer: the bound (beta1 included, before ``SAFETY``) for each micro-batch count
    tried one LP each, for every count above them (``above``), and the LP's inputs, for a caller that refines
    a count further (``flexsp.plan.refined_bound``)."""

    by_count: dict[int, float]
    above: float
    costs: DegreeCosts
    shortest: np.ndarray      # [B] each LP bucket's shortest length
    tokens: np.ndarray        # [B] its tokens
    longest: np.ndarray       # [B] its longest length
    per_token: np.ndarray     # [B, D] least GPU-seconds per token at each degree
    seq_time: np.ndarray      # [B, D] seconds of the shortest member at each degree; inf where it does not fit
    forced: np.ndarray        # ``_forced_work``

    @property
    def least(self) -> float:
        return min([self.above, *self.by_count.values()])


def coupled_by_count(lengths, cost: CostModel, cluster: Cluster, max_degree: int | None = None,
                     degrees=None, memory_split: bool = True) -> CountBounds:
    """``coupled_lower_bound`` count by count. A count whose cheapest possible value already reaches a
    smaller count's bound is not solved: it gets that cheap value (still a bound, and not the least)."""
    lengths = as_lengths(lengths).astype(np.float64)
    costs = _degree_costs(cost, cluster, max_degree, degrees, lengths)
    n = cluster.num_gpus
    times = costs.times(lengths)                                     # inf where it cannot fit
    area = (times * np.asarray(costs.degrees)[None, :]).min(axis=1)
    fewest = max(1, math.ceil(lengths.sum() / (cost.token_capacity * n) - 1e-12))
    floor = max(float(area.sum()) / n, float(times.min(axis=1).max()))   # valid for every count
    shortest, tokens, longest = _buckets(lengths)
    # per-token rates without the ring's per-sequence hop latency: with it, time / tokens would fall
    # with length and the shortest sequence's rate would overstate a bucket's longer ones
    bare = _rate_floor(costs)
    per_token = bare.times(shortest) * np.asarray(costs.degrees)[None, :] / shortest[:, None]   # [B, D]
    seq_time = costs.times(shortest)                                 # [B, D]
    last = min(fewest + EXTRA_COUNTS, len(lengths))
    split = (_split_spans(lengths, costs, area, float(cost.token_capacity), n, fewest, last) if memory_split
             else np.zeros(last - fewest + 2))                        # [counts fewest..last, every count above]
    memory = n * float(cost.token_capacity)                          # tokens one micro-batch holds
    forced = _forced_work(lengths, area, memory, n, last + 1)
    above = math.inf
    if last < len(lengths):
        # every count above ``last``: ranks beyond it pooled into one tail without memory limit
        above = (last + 1) * costs.beta1 + max(split[-1], _least_span(
            last + 1, per_token, seq_time, tokens, memory, n, floor, forced, tail=True))
    by_count: dict[int, float] = {}
    for count in range(fewest, last + 1):
        cheap = count * costs.beta1 + max(floor, split[count - fewest])
        if cheap >= min([above, *by_count.values()]):
            by_count[count] = cheap
            continue
        span = _least_span(count, per_token, seq_time, tokens, memory, n, floor, forced)
        by_count[count] = count * costs.beta1 + max(span, split[count - fewest])
    return CountBounds(by_count, float(above), costs, shortest, tokens, longest, per_token, seq_time, forced)


def _rate_floor(costs: DegreeCosts) -> DegreeCosts:
    """Costs whose seconds per token at a length never exceed the true ones at any longer length, so a bucket
    costed at its shortest member stays a bound: without the ring's per-sequence hop latency (with it, time /
    tokens would fall with length), and with chunked layers' pair terms scaled by ``CHUNK_RATE_FLOOR`` (their
    pairs per token, ``min(s, c)`` below a chunk, dip to ``2 (sqrt 2 - 1) c`` just past one)."""
    bare = dataclasses.replace(costs, hops=()) if any(costs.hops) else costs
    if isinstance(bare, TermCosts) and any(mixer == "chunk" for mixer, _ in bare.terms):
        weights = tuple(tuple(w * (CHUNK_RATE_FLOOR if mixer == "chunk" else 1.0) for w in row)
                        for (mixer, _), row in zip(bare.terms, bare.weights))
        bare = dataclasses.replace(bare, weights=weights)
    return bare


CHUNK_RATE_FLOOR = 2 * (math.sqrt(2) - 1)   # least (q c^2 + r^2) / (q c + r) over s >= c, as a share of c


def _split_spans(lengths: np.ndarray, costs: DegreeCosts, area: np.ndarray, capacity: float, n: int,
                 first: int, last: int) -> np.ndarray:
    """Lower bounds on ``S`` (the micro-batches' summed time less beta1) for each micro-batch count
    ``first..last``, then one for every count above ``last``: memory caps what the micro-batch of
    one long sequence ``s`` can compute (the largest of the bounds over the ``OWN_BUCKETS`` longest).

    Say ``s`` runs at degree ``d`` (time ``t``) in micro-batch ``1`` (time ``tau``) of ``m``. The
    other ``m - 1`` hold at most ``(m - 1) N c`` tokens (``c`` per GPU), so at least ``R = total - s -
    (m - 1) N c`` other tokens share micro-batch 1: at most ``(N - d) c`` on the other GPUs, the rest,
    ``u``, in ``s``'s group, whose time they lengthen by at least ``u rho_d`` (the least seconds per
    token at ``d``), so ``tau >= t + u rho_d``. The cheapest GPU-seconds of the others that run in
    micro-batch 1 are at most ``d (tau - t)`` in the group plus, on the other GPUs, ``(N - d) tau``
    and the most any ``(N - d) c`` tokens can carry (a fractional knapsack over GPU-seconds per
    token); the rest of their cheapest GPU-seconds need the other micro-batches, ``N`` GPUs each:

        S >= tau + max(0, A_rest - min((N - d) tau, K((N - d) c)) - d (tau - t)) / N,

    nondecreasing in ``tau``, so it holds at ``tau``'s least value; the least over ``d`` bounds any
    plan with ``m`` micro-batches. It grows as ``m`` falls, so the value where no token is forced
    into the group (``R <= (N - d) c`` for every ``d``) bounds every larger count."""
    out = np.zeros(last - first + 2)
    if len(lengths) < 2:
        return out
    bare = _rate_floor(costs)
    total = float(lengths.sum())
    order = np.argsort(lengths)[::-1]
    rate = np.divide(area, lengths, out=np.zeros_like(area), where=lengths > 0)   # cheapest GPU-s per token
    by_rate = np.argsort(rate)[::-1]
    counts = np.arange(first, last + 2, dtype=np.float64)
    counts[-1] = np.inf                                               # every count above: nothing forced
    for i in order[:OWN_BUCKETS]:
        s = float(lengths[i])
        keep = by_rate[by_rate != i]
        knap_tokens = np.concatenate([[0.0], np.cumsum(lengths[keep])])
        knap_area = np.concatenate([[0.0], np.cumsum(area[keep])])
        knap_rate = rate[keep]                                        # descending
        a_rest = float(area.sum() - area[i])
        others = np.delete(lengths, i)
        shortest = float(others[others > 0].min()) if (others > 0).any() else 0.0
        best = np.full(counts.shape, np.inf)
        for k, d in enumerate(costs.degrees):
            t = float(costs.seconds(np.asarray([s]), k)[0])
            if not np.isfinite(t) or s > costs.capacity[k] or d > n:
                continue
            rho = float(bare.seconds(np.asarray([shortest]), k)[0]) / shortest if shortest else 0.0  # least s/token at d
            room_rest = capacity * (n - d)
            forced = np.where(np.isfinite(counts), total - s - (counts - 1) * n * capacity, -np.inf)
            u = np.maximum(0.0, forced - room_rest)
            tau = t + np.where(u > 0, u * rho, 0.0)
            carried = np.interp(room_rest, knap_tokens, knap_area)   # fractional knapsack
            removed = np.minimum((n - d) * tau, carried) + d * (tau - t)
            span = tau + np.maximum(0.0, a_rest - removed) / n
            # second view: the group's extra tokens cost u rho_d of time but carry at most K(u + (N-d) c)
            # of the others' cheapest GPU-seconds; convex in u, least where the knapsack's marginal rate
            # falls to N rho_d (or at the ends of u's range)
            top = np.searchsorted(-knap_rate, -n * rho, side="left")      # first item at most N rho_d
            best_u = np.clip(knap_tokens[top] - room_rest, u, max(costs.capacity[k] - s, 0.0))
            moved = np.interp(best_u + room_rest, knap_tokens, knap_area)
            span = np.maximum(span, t + best_u * rho + (a_rest - moved) / n)
            span = np.where(u > costs.capacity[k] - s, np.inf, span)
            best = np.minimum(best, span)
        out = np.maximum(out, best)
    return out


def _buckets(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shortest length, total tokens and longest length of each LP bucket; the longest sequences alone."""
    order = np.sort(lengths)
    own = order[-OWN_BUCKETS:]
    rest = order[:-OWN_BUCKETS]
    shortest, tokens, longest = list(own), list(own), list(own)
    if rest.size:
        buckets = dp_buckets(rest.astype(np.int64), BOUND_BUCKETS)
        nb = len(buckets.upper)
        low, high = np.full(nb, np.inf), np.full(nb, -np.inf)
        np.minimum.at(low, buckets.index, rest)
        np.maximum.at(high, buckets.index, rest)
        mass = np.bincount(buckets.index, weights=rest, minlength=nb)
        keep = mass > 0
        shortest += list(low[keep])
        tokens += list(mass[keep])
        longest += list(high[keep])
    return tuple(np.asarray(v, dtype=np.float64) for v in (shortest, tokens, longest))


def _forced_work(lengths: np.ndarray, area: np.ndarray, memory: float, num_gpus: int, count: int) -> np.ndarray:
    """``[count]``: ``w_j``, the least seconds per GPU of the tokens that the ``j`` largest micro-batches cannot
    hold (``total - j x memory`` of them, the cheapest GPU-seconds per token first, fractionally).

    In any plan sorted by micro-batch time, ``j tau_j <= tau_1 + ... + tau_j = S - (tau_(j+1) + ...)``, and the
    micro-batches after the ``j``-th hold those tokens, so ``tau_j <= (S - w_j) / j``: a long sequence in the
    largest micro-batch must finish while the others run the tokens it has no room for, not within all of
    ``S`` (the gpt-7b constants at 16,384 GPUs: 0.3 s of a 2.3 s span)."""
    lengths, area = lengths[lengths > 0], area[lengths > 0]   # no tokens: nothing to be forced out
    total = float(lengths.sum())
    rate = area / lengths
    order = np.argsort(rate, kind="stable")
    cum_tokens = np.concatenate([[0.0], np.cumsum(lengths[order])])
    cum_area = np.concatenate([[0.0], np.cumsum(area[order])])
    left = np.maximum(0.0, total - memory * np.arange(1, count + 1))
    return np.interp(left, cum_tokens, cum_area) / num_gpus


def _rates(span: float, count: int, per_token: np.ndarray, seq_time: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """``[B, count]`` least GPU-seconds per token of each bucket in micro-batch rank ``j`` (time
    budget ``(span - w_j) / j``, ``_forced_work``); inf where no degree finishes it in time."""
    budget = (span - forced[:count]) / np.arange(1, count + 1)       # [M]
    ok = seq_time[:, :, None] <= budget[None, None, :] * (1 + 1e-12)  # [B, D, M]
    return np.where(ok, per_token[:, :, None], np.inf).min(axis=1)


def _least_span(count: int, per_token: np.ndarray, seq_time: np.ndarray, tokens: np.ndarray,
                memory: float, num_gpus: int, floor: float, forced: np.ndarray, tail: bool = False) -> float:
    """Least ``S`` for which the token assignment LP is feasible with ``count`` micro-batches
    (``tail``: the last rank stands for all ranks from ``count`` on, with no memory limit).

    The rates change only at breakpoints ``j x seq_time[b, d] + w_j``; bisect them for the first
    feasible one, then solve the LP for ``S`` itself on the interval below it."""
    finite = seq_time[np.isfinite(seq_time)]
    points = np.unique((finite[:, None] * np.arange(1, count + 1)[None, :] + forced[None, :count]).ravel())
    points = points[points > floor]
    top = max(points[-1] if points.size else floor, floor) * 2 + count * float(
        (tokens * np.where(np.isfinite(per_token), per_token, np.inf).min(axis=1)).sum()) / num_gpus
    points = np.concatenate([[floor], points, [top]])
    lo, hi = 0, len(points) - 1
    if _solve(points[0], points[0], count, per_token, seq_time, tokens, memory, num_gpus, forced, tail) is not None:
        return float(points[0])
    if _solve(points[hi], points[hi], count, per_token, seq_time, tokens, memory, num_gpus, forced, tail) is None:
        return float(points[hi])      # not even then: memory; the counts above take over
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _solve(points[mid], points[mid], count, per_token, seq_time, tokens, memory, num_gpus, forced, tail) is not None:
            hi = mid
        else:
            lo = mid
    inside = _solve(points[lo], points[hi], count, per_token, seq_time, tokens, memory, num_gpus, forced, tail)
    return float(points[hi] if inside is None else inside)


def _solve(rate_at: float, upper: float, count: int, per_token: np.ndarray, seq_time: np.ndarray,
           tokens: np.ndarray, memory: float, num_gpus: int, forced: np.ndarray, tail: bool = False) -> float | None:
    """Least ``S`` in ``[rate_at, upper]`` with the rates at ``rate_at``; None if infeasible.

    Variables: ``z[b, j]``, the share of bucket ``b``'s tokens in micro-batch rank ``j``, then ``S``;
    rows scaled to O(1) (memory in micro-batches, GPU-seconds per GPU in seconds)."""
    from scipy.optimize import linprog  # slow to import; only bound users pay
    rates = _rates(rate_at, count, per_token, seq_time, forced)       # [B, M]
    nb = len(tokens)
    nvar = nb * count + 1
    finite = np.isfinite(rates)
    work = np.where(finite, rates, 0.0) * tokens[:, None] / num_gpus  # seconds per GPU if all of b is in j
    a_eq = np.zeros((nb, nvar))
    for b in range(nb):
        a_eq[b, b * count:(b + 1) * count] = 1.0
    a_ub = np.zeros((2 * count + 1, nvar))
    b_ub = np.zeros(2 * count + 1)
    for j in range(count - 1 if tail else count):
        a_ub[j, j:nb * count:count] = tokens / memory                 # memory of micro-batch j
        b_ub[j] = 1.0
        a_ub[count + j, j:nb * count:count] = work[:, j]              # its GPU-seconds <= N (S - w_j) / (j+1)
        a_ub[count + j, -1] = -1.0 / (j + 1)
        b_ub[count + j] = -forced[j] / (j + 1)
    a_ub[-1, :-1] = work.ravel()                                      # all GPU-seconds <= N S
    a_ub[-1, -1] = -1.0
    bounds = [(0.0, 1.0 if ok else 0.0) for ok in finite.ravel()] + [(rate_at, upper)]
    c = np.zeros(nvar)
    c[-1] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(nb), bounds=bounds, method="highs")
    if res.status == 2:
        return None
    # only a proven infeasibility may raise the bound: an unfinished solve (iteration limit, numerical trouble)
    # answers the interval's least span
    return float(res.x[-1]) if res.status == 0 else rate_at


def gap_breakdown(plan, lengths, cost: CostModel, cluster: Cluster, degrees=None) -> dict[str, float]:
    """What a plan's time is made of, in seconds that sum to ``plan.time``:

    * ``area``: every sequence at its cheapest degree, spread perfectly over all GPUs (the simple
      bound's compute term; no plan does better);
    * ``degree``: the extra GPU-seconds of running sequences at the degrees the plan chose rather than
      their cheapest, spread over all GPUs (paid for memory or to shorten a critical path);
    * ``idle``: GPUs waiting in a micro-batch for its slowest group (and GPUs left without a group);
    * ``beta1``: the fixed cost of the fewest micro-batches memory allows (``area + beta1`` is the
      simple ``lower_bound``);
    * ``extra_micro_batches``: beta1 of each micro-batch beyond those.

    ``degree + idle + extra_micro_batches`` is what separates a plan from the simple bound; the
    coupled bound sits above it where long sequences force degrees or micro-batches, so the gap to
    the coupled bound is that sum minus ``coupled_lower_bound - lower_bound``."""
    lengths = as_lengths(lengths).astype(np.float64)
    n = cluster.num_gpus
    costs = _degree_costs(cost, cluster, None, degrees, lengths)
    cheapest = (costs.times(lengths) * np.asarray(costs.degrees)[None, :]).min(axis=1)
    area = float(cheapest.sum()) / n
    used, idle = 0.0, 0.0
    for times, mb in zip(plan.group_times(lengths, cost), plan.micro_batches):
        busy = sum((t - cost.beta1) * g.degree for t, g in zip(times, mb.groups))
        used += busy
        idle += (max(times) - cost.beta1) * n - busy
    fewest = min(len(plan.micro_batches), max(1, math.ceil(lengths.sum() / (cost.token_capacity * n) - 1e-12)))
    return {"area": area, "degree": used / n - area, "idle": idle / n, "beta1": cost.beta1 * fewest,
            "extra_micro_batches": cost.beta1 * (len(plan.micro_batches) - fewest)}
