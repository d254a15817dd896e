"""Online refit of the cost model from measured group times. Torch-free (numpy, scipy).

A group of degree ``d`` holding sequences ``S`` is modelled (``flexsp.plan.cost``) as

    t = alpha1 * sum(s^2)/d + (alpha2 + c_d) * sum(s)/d + beta1,    c_d = comm_bytes_per_token / bandwidth[d]

which is linear in ``(alpha1, alpha2, beta1, c_2, c_4, ...)``. A model with windowed or chunked layers
(``CostModel.window_alpha`` / ``chunk_alpha``) adds ``sum_j alpha_j * pairs_j(S) / d``; its attention is refitted
as one ratio on ``alpha1`` and every ``alpha_j`` together (the same kernels at another rate), so each
observation also keeps its pair sums per term. ``Refitter`` keeps a sliding window of
observations *per degree* (so a frequent degree cannot crowd out a rare one), and solves a
non-negative least squares on relative residuals, made robust by iteratively reweighting with
Huber weights (an outlier step, e.g. a checkpoint write, gets a small weight). Each unknown is
expressed as a ratio to the current model's value, with a weak prior row pulling it to 1: what the
data cannot tell apart (``alpha2`` from the communication term when no degree-1 group was
measured) stays where it was. Communication is thus separated from compute where degree-1 groups
are measured. Groups on a ring axis are not used (their overlap term is not linear).

A refit only replaces ``alpha1``, ``alpha2``, ``beta1`` and the bandwidths: ``token_capacity`` (and
so every plan's memory margin) never changes, and a refit that does not lower the window's error is
not handed out.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from flexsp.errors import CostModelError
from flexsp.plan.cost import CostModel
from flexsp.plan.layers import pairs


@dataclass(frozen=True)
class RefitConfig:
    window: int = 64            # observations kept per degree
    every: int = 1              # steps between refits
    min_points: int = 8         # observations (all degrees) before the first refit
    huber: float = 0.05         # relative residual beyond which an observation's weight shrinks
    prior_weight: float = 0.01  # pull of each coefficient towards the current model (ratio units)
    max_change: float = 1e4     # a refit moves no coefficient by more than this factor

    def __post_init__(self) -> None:
        for name in ("window", "every", "min_points"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise CostModelError(f"RefitConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("huber", "prior_weight", "max_change"):
            if not getattr(self, name) > 0:
                raise CostModelError(f"RefitConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Observation:
    degree: int
    sum_sq: float      # sum of s^2 over the group's sequences
    sum_len: float     # sum of s
    seconds: float     # measured
    terms: tuple[float, ...] = ()   # per window/chunk term of the cost model: sum of pairs(s) (flexsp.plan.layers)


def predict(cost: CostModel, obs: Iterable[Observation]) -> np.ndarray:
    """The cost model's time for each observation (the same formula ``CostModel.group_time`` uses)."""
    out = []
    for o in obs:
        quad, lin, _ = cost.coefficients(o.degree)
        out.append(quad * o.sum_sq + lin * o.sum_len + cost.beta1 + _term_seconds(cost, o))
    return np.asarray(out, dtype=np.float64)


def _term_seconds(cost: CostModel, o: Observation) -> float:
    """Seconds of the window/chunk terms of one observation at its degree (0 for a model without them)."""
    return sum(a * t for a, t in zip(cost.terms_alpha(), o.terms)) / o.degree


def relative_error(cost: CostModel, obs: list[Observation]) -> float:
    """Median |predicted - measured| / measured over ``obs`` (nan if empty)."""
    if not obs:
        return float("nan")
    measured = np.asarray([o.seconds for o in obs])
    return float(np.median(np.abs(predict(cost, obs) - measured) / measured))


class Refitter:
    """Collects measured group times and refits ``cost`` from them (module docstring)."""

    def __init__(self, cost: CostModel, config: RefitConfig | None = None) -> None:
        self.cost, self.config = cost, config or RefitConfig()
        self.windows: dict[int, collections.deque[Observation]] = {}
        self.version = 0
        self._since = 0

    # --- observations ---------------------------------------------------------------------------
    def observe(self, degree: int, lengths: Iterable[int], seconds: float, ring: int = 1) -> None:
        if ring > 1 or not seconds > 0 or not np.isfinite(seconds):
            return
        s = np.asarray(list(lengths), dtype=np.float64)
        window = self.windows.setdefault(int(degree), collections.deque(maxlen=self.config.window))
        terms = tuple(float(pairs(s, mixer, size).sum()) for mixer, size in self.cost.terms)
        window.append(Observation(int(degree), float(np.square(s).sum()), float(s.sum()), float(seconds), terms))

    def observe_record(self, record: Mapping[str, Any]) -> None:
        """Every group of a step record (``flexsp.telemetry.records``)."""
        for mb in record["micro_batches"]:
            for g in mb["groups"]:
                self.observe(g["degree"], g["lengths"], g["measured"], g.get("ring", 1))
        self._since += 1

    @property
    def observations(self) -> list[Observation]:
        return [o for d in sorted(self.windows) for o in self.windows[d]]

    # --- the fit ----------------------------------------------------------------------------------
    def due(self) -> bool:
        return self._since >= self.config.every and len(self.observations) >= self.config.min_points

    def refit(self) -> CostModel | None:
        """A new cost model if one fits the window better than the current one, else None."""
        from scipy.optimize import lsq_linear  # 0.4 s to import: paid by a run that refits, not by every one
        self._since = 0
        obs = self.observations
        if len(obs) < self.config.min_points:
            return None
        cost, cfg = self.cost, self.config
        comm_degrees = sorted({o.degree for o in obs if o.degree > 1}) if cost.comm_bytes_per_token > 0 else []
        measured = np.asarray([o.seconds for o in obs])
        typical = float(np.median(measured))
        # current values (a zero one gets a scale from the data so its ratio can still move)
        prior = [cost.alpha1, cost.alpha2, cost.beta1] + [cost.alltoall_bytes(d) / cost.bandwidth(d)
                                                           for d in comm_degrees]
        attention = np.asarray([o.sum_sq / o.degree for o in obs])
        if cost.terms:   # alpha1 and the window/chunk alphas as one ratio: the column is their seconds now
            attention = attention * cost.alpha1 + np.asarray([_term_seconds(cost, o) for o in obs])
            prior[0] = 1.0
        columns = [attention, np.asarray([o.sum_len / o.degree for o in obs]),
                   np.ones(len(obs))] + [np.asarray([o.sum_len / o.degree if o.degree == d else 0.0 for o in obs])
                                         for d in comm_degrees]
        scale = np.asarray([p if p > 0 else typical / max(float(np.max(c)), 1e-300) for p, c in zip(prior, columns)])
        A = np.stack(columns, axis=1) * scale / measured[:, None]        # unknowns: ratios to `scale`
        anchor = np.asarray([1.0 if p > 0 else 0.0 for p in prior])
        weights = np.ones(len(obs))
        ratios = anchor.copy()
        upper = np.where(anchor > 0, cfg.max_change, np.inf)
        for _ in range(6):   # iteratively reweighted: Huber weights on relative residuals
            rows = np.vstack([A * weights[:, None], cfg.prior_weight * np.eye(len(prior))])
            target = np.concatenate([weights, cfg.prior_weight * anchor])
            ratios = lsq_linear(rows, target, bounds=(np.where(anchor > 0, 1 / cfg.max_change, 0.0), upper)).x
            residual = np.abs(A @ ratios - 1.0)
            weights = np.sqrt(np.minimum(1.0, cfg.huber / np.maximum(residual, 1e-12)))
        values = ratios * scale
        alpha1, alpha2, beta1 = (float(v) for v in values[:3])
        terms = {}
        if cost.terms:
            alpha1, ratio = cost.alpha1 * float(values[0]), float(values[0])
            terms = {"window_alpha": {w: a * ratio for w, a in cost.window_alpha.items()},
                     "chunk_alpha": {c: a * ratio for c, a in cost.chunk_alpha.items()}}
        bandwidth = dict(cost.alltoall_bandwidth)
        for d, c in zip(comm_degrees, values[3:]):
            if c > 0:
                bandwidth[d] = cost.alltoall_bytes(d) / float(c)
        before = relative_error(cost, obs)
        try:
            candidate = dataclasses.replace(cost, alpha1=alpha1, alpha2=alpha2, beta1=beta1,
                                            alltoall_bandwidth=bandwidth, **terms,
                                            meta={**cost.meta, "refit": {"version": self.version + 1,
                                                                         "points": len(obs)}})
        except CostModelError:
            return None   # out of the representable range: keep the current model
        after = relative_error(candidate, obs)
        if not after < before:
            return None
        assert candidate.token_capacity == cost.token_capacity   # a refit never touches memory
        candidate.meta["refit"].update(error_before=before, error_after=after)
        self.cost, self.version = candidate, self.version + 1
        return candidate
