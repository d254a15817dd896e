"""Least-squares fits of the cost model's coefficients from measurements. Pure numpy/scipy, no torch.

Compute: ``time(s) = alpha1*s^2 + alpha2*s + beta1`` for one sequence of ``s`` tokens at SP degree 1.
Communication: ``time(bytes) = latency + bytes / bandwidth`` per SP degree, where ``bytes`` is one
rank's all-to-all payload (the unit ``CostModel.alltoall_bandwidth`` uses); the same fit for one ring
hop, ``bytes`` being what one rank sends its next ring neighbour (``CostModel.ring_bandwidth``).

Both fits are non-negative least squares on *relative* residuals (each row divided by its measured
time): timings span orders of magnitude, and an absolute fit would let the longest point decide
everything and leave the short ones, which are most sequences, with large relative errors.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import nnls

from flexsp.errors import CostModelError

MIN_COMPUTE_POINTS = 4   # 3 coefficients + at least one spare point, so the reported error means something
MIN_COMM_POINTS = 3      # 2 coefficients + one spare point


class FitWarning(UserWarning):
    """A fitted coefficient came out zero: the sweep could not resolve that term."""


@dataclass(frozen=True)
class FitPoint:
    """One measured x (tokens or bytes) with its measured and fitted seconds."""

    x: float
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return (self.predicted - self.measured) / self.measured


class _FitErrors:
    """Relative-error summaries over a fit's ``points``."""

    points: tuple[FitPoint, ...]

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean([abs(p.rel_error) for p in self.points]))

    @property
    def max_abs_error(self) -> float:
        return float(np.max([abs(p.rel_error) for p in self.points]))


@dataclass(frozen=True)
class ComputeFit(_FitErrors):
    alpha1: float     # s per token^2
    alpha2: float     # s per token
    beta1: float      # s, fixed per group per micro-batch
    points: tuple[FitPoint, ...]

    def predict(self, length: float) -> float:
        return self.alpha1 * length * length + self.alpha2 * length + self.beta1

    def to_dict(self) -> dict:
        return {"alpha1": self.alpha1, "alpha2": self.alpha2, "beta1": self.beta1,
                "mean_abs_rel_error": self.mean_abs_error, "max_abs_rel_error": self.max_abs_error,
                "points": [dict(asdict(p), rel_error=p.rel_error) for p in self.points]}


@dataclass(frozen=True)
class BandwidthFit(_FitErrors):
    degree: int
    latency: float     # s per all-to-all
    bandwidth: float   # bytes of one rank's payload per second
    points: tuple[FitPoint, ...]

    def to_dict(self) -> dict:
        return {"degree": self.degree, "latency": self.latency, "bandwidth": self.bandwidth,
                "mean_abs_rel_error": self.mean_abs_error, "max_abs_rel_error": self.max_abs_error,
                "points": [dict(asdict(p), rel_error=p.rel_error) for p in self.points]}


def _clean(xs: Iterable[float], times: Iterable[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(list(xs), dtype=np.float64)
    t = np.asarray(list(times), dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise CostModelError(f"{what}: need one time per point, got {x.size} points and {t.size} times")
    bad = [(float(a), float(b)) for a, b in zip(x, t) if not (math.isfinite(a) and a > 0 and math.isfinite(b) and b > 0)]
    if bad:
        raise CostModelError(f"{what}: points and times must be finite and > 0, got (x, seconds) {bad[:4]}")
    return x, t


STATISTICS = {"median": np.median, "min": np.min}


def _aggregate(x: np.ndarray, t: np.ndarray, statistic: str = "median") -> tuple[np.ndarray, np.ndarray]:
    """One time per distinct x, so repeats of a point do not outweigh other points. ``median`` ignores
    the odd slow repeat; ``min`` suits a shared machine, where other work only ever adds time."""
    if statistic not in STATISTICS:
        raise CostModelError(f"unknown statistic {statistic!r}; choose one of {sorted(STATISTICS)}")
    keys = np.unique(x)
    return keys, np.array([STATISTICS[statistic](t[x == k]) for k in keys])


def _nnls_relative(design: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin ||(design @ c - t) / t|| subject to c >= 0; columns scaled to unit norm for conditioning."""
    a = design / t[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, np.ones_like(t))
    coef = coef / scale
    # A term adding under a billionth of every time is rounding noise from NNLS: call it what it is, 0.
    coef[np.max(design * coef, axis=0) < 1e-9 * t.max()] = 0.0
    return coef


def fit_compute(lengths: Sequence[float], seconds: Sequence[float], *, strict: bool = False,
                statistic: str = "median") -> ComputeFit:
    """Fit ``alpha1, alpha2, beta1 >= 0`` to fwd+bwd times of single sequences at SP degree 1.

    Repeated lengths are reduced to one time by ``statistic`` (median or min). Needs ``MIN_COMPUTE_POINTS`` distinct lengths.
    A coefficient fitted to exactly 0 means the data wanted it negative (noise, or a sweep too short
    for the quadratic term to show): a ``FitWarning``, or ``CostModelError`` with ``strict``; both
    alpha1 and alpha2 zero is always an error.
    """
    x, t = _aggregate(*_clean(lengths, seconds, "compute fit"), statistic)
    if x.size < MIN_COMPUTE_POINTS:
        raise CostModelError(f"compute fit needs at least {MIN_COMPUTE_POINTS} distinct sequence lengths "
                             f"(3 coefficients + 1 to measure the error), got {x.size}: {x.astype(int).tolist()}")
    alpha1, alpha2, beta1 = _nnls_relative(np.stack([x * x, x, np.ones_like(x)], axis=1), t)
    fit = ComputeFit(float(alpha1), float(alpha2), float(beta1), ())
    points = tuple(FitPoint(float(a), float(b), fit.predict(a)) for a, b in zip(x, t))
    fit = ComputeFit(fit.alpha1, fit.alpha2, fit.beta1, points)
    if fit.alpha1 == 0 and fit.alpha2 == 0:
        raise CostModelError(f"compute fit gave alpha1 = alpha2 = 0 from lengths {x.astype(int).tolist()}: "
                             "the times do not grow with length; measure longer sequences")
    zero = [name for name in ("alpha1", "alpha2", "beta1") if getattr(fit, name) <= 0]
    if zero:
        hint = {"alpha1": "add longer sequences so attention's s^2 term shows",
                "alpha2": "add more mid-length sequences",
                "beta1": "add very short sequences so the fixed overhead shows"}
        message = (f"compute fit: {', '.join(zero)} fitted to 0 (least squares wanted it negative) from lengths "
                   f"{x.astype(int).tolist()}; {'; '.join(hint[z] for z in zero)}")
        if strict:
            raise CostModelError(message)
        warnings.warn(message, FitWarning, stacklevel=2)
    return fit


def fit_bandwidth(degree: int, payload_bytes: Sequence[float], seconds: Sequence[float], *,
                  statistic: str = "median", what: str = "all-to-all") -> BandwidthFit:
    """Fit ``latency >= 0`` and ``bandwidth > 0`` to the times of one message pattern over ``degree``
    ranks: an all-to-all of one SP degree, or (``what="ring"``) one hop around a ring of ``degree``
    ranks (``flexsp.profile.ring``). ``what`` only names the pattern in errors."""
    name = f"{what} fit for degree {degree}"
    x, t = _aggregate(*_clean(payload_bytes, seconds, name), statistic)
    if x.size < MIN_COMM_POINTS:
        raise CostModelError(f"{name} needs at least {MIN_COMM_POINTS} distinct message "
                             f"sizes (latency + bandwidth + 1 to measure the error), got {x.size}: {x.astype(int).tolist()}")
    latency, inverse = _nnls_relative(np.stack([np.ones_like(x), x], axis=1), t)
    if inverse <= 0:
        raise CostModelError(f"{name}: time does not grow with message size over "
                             f"{x.astype(int).tolist()} bytes; measure larger messages")
    points = tuple(FitPoint(float(a), float(b), float(latency + inverse * a)) for a, b in zip(x, t))
    return BandwidthFit(int(degree), float(latency), float(1.0 / inverse), points)
