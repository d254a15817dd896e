"""Least-squares fits of the cost model's coefficients from measurements. Pure numpy/scipy, no torch.

Compute: ``time(s) = alpha1*s^2 + alpha2*s + beta1`` for one sequence of ``s`` tokens at SP degree 1.
Per layer kind (``fit_kind``, a model with windowed, chunked or linear-attention layers): one layer's time
``alpha * work(s) + alpha2*s + beta1``, ``work`` its attention pairs (``flexsp.plan.layers.pairs``: ``s^2``
for a full layer, about ``2 w s`` for a window ``w``, ``c s`` for a chunk ``c``, none for a linear layer);
``combine_kinds`` sums the kinds' layers and the rest of the model into the cost model's terms.
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

from flexsp.errors import CostModelError
from flexsp.plan.layers import SIZED, pairs

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
    from scipy.optimize import nnls  # 0.4 s to import: paid by fits, not by every `flexsp` command
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


# --- per layer kind -------------------------------------------------------------------------------
WORKS = ("square", "pairs", "none")   # a kind's attention term: s^2, its pair count, or none (linear layers)
# A window or chunk is fitted as s^2 only where that fit's error is under half the pair count's: where the layer's
# attention is a small part of its time the two fit alike, and a spurious s^2 would grow without bound beyond the
# sweep, while a kernel that really computes the whole masked matrix misses a pair-count fit by far more.
SQUARE_MARGIN = 2.0


@dataclass(frozen=True)
class KindFit(_FitErrors):
    """One layer of one kind: ``time(s) = alpha * work(s) + alpha2*s + beta1``.

    ``work`` is ``"square"`` (``s^2``: a full layer, or a windowed/chunked one whose kernel computes the whole
    masked score matrix), ``"pairs"`` (``flexsp.plan.layers.pairs``: a kernel that skips what the window or
    chunk masks) or ``"none"`` (a linear-attention layer: no pair term)."""

    mixer: str
    size: int
    layers: int       # layers of this kind in the whole model
    work: str
    alpha: float      # s per unit of work, one layer
    alpha2: float     # s per token, one layer
    beta1: float      # s, one layer
    points: tuple[FitPoint, ...]
    estimated: str = ""   # why the kind was not timed ("": it was); its terms are then another kind's

    @property
    def name(self) -> str:
        return self.mixer + (f" {self.size}" if self.size else "")

    def predict(self, length: float) -> float:
        return float(self.alpha * _work(np.asarray([float(length)]), self.mixer, self.size, self.work)[0]
                     + self.alpha2 * length + self.beta1)

    def to_dict(self) -> dict:
        out = {"mixer": self.mixer, "size": self.size, "layers": self.layers, "work": self.work, "alpha": self.alpha,
               "alpha2": self.alpha2, "beta1": self.beta1,
               "mean_abs_rel_error": self.mean_abs_error if self.points else None,
               "max_abs_rel_error": self.max_abs_error if self.points else None,
               "points": [dict(asdict(p), rel_error=p.rel_error) for p in self.points]}
        if self.estimated:
            out["estimated"] = self.estimated
        return out


def _work(s: np.ndarray, mixer: str, size: int, work: str) -> np.ndarray:
    if work == "square":
        return s * s
    if work == "pairs":
        return pairs(s, mixer, size)
    return np.zeros_like(s)


def fit_kind(mixer: str, size: int, layers: int, lengths: Sequence[float], seconds: Sequence[float], *,
             statistic: str = "median") -> KindFit:
    """Fit one layer of kind ``mixer`` (``size``: its window or chunk) to its measured times.

    Full layers fit ``s^2``; linear-attention layers no pair term; a window or chunk is fitted both ways, as
    its pair count and as ``s^2``, and keeps the pair count unless ``s^2`` fits clearly better
    (``SQUARE_MARGIN``): the runtime's kernel on
    this device either skips the masked blocks (flash-attn's window, chunked bounds) or computes the whole
    masked matrix (the explicit per-sequence path), and the record says which (``work``). Above the window
    ``pairs`` is affine in ``s``: lengths below the window tell its term from the linear one."""
    what = f"layer kind {mixer}{f' {size}' if size else ''}"
    x, t = _aggregate(*_clean(lengths, seconds, f"{what} fit"), statistic)
    if x.size < MIN_COMPUTE_POINTS:
        raise CostModelError(f"{what} fit needs at least {MIN_COMPUTE_POINTS} distinct sequence lengths, got "
                             f"{x.size}: {x.astype(int).tolist()}")
    works = ("pairs", "square") if mixer in SIZED else ("square",) if mixer == "full" else ("none",)
    best = None
    for work in works:      # pairs first: s^2 replaces it only when it fits clearly better (SQUARE_MARGIN)
        columns = [x, np.ones_like(x)] if work == "none" else [_work(x, mixer, size, work), x, np.ones_like(x)]
        coef = _nnls_relative(np.stack(columns, axis=1), t)
        alpha, alpha2, beta1 = (0.0, *coef) if work == "none" else coef
        fit = KindFit(mixer, int(size), int(layers), work, float(alpha), float(alpha2), float(beta1), ())
        fit = KindFit(**{**fit.__dict__, "points": tuple(FitPoint(float(a), float(b), fit.predict(a))
                                                          for a, b in zip(x, t))})
        if best is None or fit.mean_abs_error * SQUARE_MARGIN < best.mean_abs_error:
            best = fit
    if best.alpha == 0 and best.alpha2 == 0:
        raise CostModelError(f"{what} fit: the layer's time does not grow with length over {x.astype(int).tolist()}; "
                             f"measure longer sequences")
    return best


def layer_seconds(lengths: Sequence[float], with_layers: Sequence[float], without: Sequence[float], blocks: int, *,
                  statistic: str = "median", what: str = "layer") -> tuple[np.ndarray, np.ndarray]:
    """One layer's seconds per distinct length: ``(statistic(T_blocks) - statistic(T_0)) / blocks``, the times of
    the model with ``blocks`` layers of the kind and without any (both timed at every length in ``lengths``)."""
    xs, with_t = _aggregate(*_clean(lengths, with_layers, f"{what} timings"), statistic)
    xs0, without_t = _aggregate(*_clean(lengths, without, f"{what} timings (no layers)"), statistic)
    if not np.array_equal(xs, xs0):
        raise CostModelError(f"{what}: timed at lengths {xs.astype(int).tolist()} but the model without layers at "
                             f"{xs0.astype(int).tolist()}")
    per_layer = (with_t - without_t) / blocks
    bad = [int(n) for n, v in zip(xs, per_layer) if not v > 0]
    if bad:
        raise CostModelError(f"{what}: {blocks} layer(s) took no time beyond the model without them at lengths {bad} "
                             f"(noisy timings: more --repeats, --statistic min, more --run-layers, an idle machine)")
    return xs, per_layer


@dataclass(frozen=True)
class KindsModel:
    """The kinds' fits summed over the model: the cost model's terms and the fit of the whole model's time."""

    total: ComputeFit                     # alpha1 = the square-work kinds' terms; points: whole-model times
    window_alpha: dict[int, float]
    chunk_alpha: dict[int, float]
    kinds: tuple[KindFit, ...]
    base: ComputeFit                      # the model without layers (embedding, head, loss): alpha1 = 0


def combine_kinds(base: ComputeFit, kinds: Sequence[KindFit], lengths: Sequence[float],
                  measured: Sequence[float]) -> KindsModel:
    """Sum ``kinds`` (each ``layers`` times) and ``base`` into ``alpha1 s^2 + Σ window/chunk terms + alpha2 s +
    beta1``, and its error against ``measured`` whole-model seconds (the layers' times added to the base's)."""
    alpha1 = sum(k.layers * k.alpha for k in kinds if k.work == "square")
    window = {k.size: k.layers * k.alpha for k in kinds if k.work == "pairs" and k.mixer == "window"}
    chunk = {k.size: k.layers * k.alpha for k in kinds if k.work == "pairs" and k.mixer == "chunk"}
    alpha2 = base.alpha2 + sum(k.layers * k.alpha2 for k in kinds)
    beta1 = base.beta1 + sum(k.layers * k.beta1 for k in kinds)
    x = np.asarray(lengths, dtype=np.float64)
    predicted = base.alpha2 * x + base.beta1 + sum(k.layers * np.array([k.predict(n) for n in x]) for k in kinds)
    points = tuple(FitPoint(float(a), float(b), float(c)) for a, b, c in zip(x, measured, predicted))
    return KindsModel(ComputeFit(float(alpha1), float(alpha2), float(beta1), points), window, chunk, tuple(kinds), base)


def fit_base(lengths: Sequence[float], seconds: Sequence[float], *, statistic: str = "median") -> ComputeFit:
    """The model without layers (embedding, LM head, loss): ``alpha2*s + beta1``, no attention."""
    x, t = _aggregate(*_clean(lengths, seconds, "fit of the model without layers"), statistic)
    alpha2, beta1 = _nnls_relative(np.stack([x, np.ones_like(x)], axis=1), t)
    points = tuple(FitPoint(float(a), float(b), float(alpha2 * a + beta1)) for a, b in zip(x, t))
    return ComputeFit(0.0, float(alpha2), float(beta1), points)


def fit_kinds(lengths: Sequence[float], base: Sequence[float], timed: Sequence[tuple[str, int, int, Sequence[float]]],
              blocks: int, *, untimed: Sequence[tuple[str, int, int, str]] = (),
              statistic: str = "median") -> KindsModel:
    """Fit every timed kind apart and sum them with the model without layers.

    ``base``: seconds of the model without layers at each of ``lengths`` (one per run); ``timed``: per kind
    ``(mixer, size, layers in the model, seconds of the model with blocks layers of it)``; ``untimed``:
    ``(mixer, size, layers, why)`` of kinds this machine could not run, costed with the linear and fixed terms
    of the full kind (else the first timed one) and no pair term, marked ``estimated``."""
    if not timed:
        raise CostModelError("no layer kind of this model could be timed: "
                             + "; ".join(f"{m} {s}: {why}" if s else f"{m}: {why}" for m, s, _, why in untimed))
    fits, per_layer = [], {}
    for mixer, size, layers, seconds in timed:
        what = f"layer kind {mixer}{f' {size}' if size else ''}"
        xs, one = layer_seconds(lengths, seconds, base, blocks, statistic=statistic, what=what)
        fits.append(fit_kind(mixer, size, layers, xs, one, statistic=statistic))
        per_layer[(mixer, size)] = one
    like = next((f for f in fits if f.mixer == "full"), fits[0])
    for mixer, size, layers, why in untimed:
        fits.append(KindFit(mixer, int(size), int(layers), "none", 0.0, like.alpha2, like.beta1, (),
                            estimated=f"not timed ({why}); costed with the {like.name} layer's linear and fixed "
                                      f"terms, without the mixer's own work"))
    base_fit = fit_base(lengths, base, statistic=statistic)
    xs, base_t = _aggregate(*_clean(lengths, base, "model without layers"), statistic)
    measured = base_t + sum(f.layers * (per_layer[(f.mixer, f.size)] if not f.estimated
                                        else np.array([f.predict(n) for n in xs])) for f in fits)
    return combine_kinds(base_fit, fits, xs, measured)
