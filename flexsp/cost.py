"""The paper's alpha-beta cost model (FlexSP Eqs. 11-14) and its token-capacity memory model.

    seq_time(s, d)   = (alpha1*s^2 + alpha2*s)/d + [d>1] * comm_bytes_per_token*s/d / bandwidth[d]
    group_time(S, d) = sum(seq_time(s, d) for s in S) + beta1
    fits(S, d)       = sum(S)/d <= token_capacity

Ulysses cannot split a sequence over more ranks than the model has attention heads. When the model
knows its ``heads``, a degree ``d`` above the Ulysses limit ``U`` (the largest power of two dividing
``heads``) is costed as the USP-style hybrid practitioners run: Ulysses over ``u = U`` ranks (the
all-to-all at ``bandwidth[u]`` on a ``s/d`` payload) times a ring of ``r = d/u`` ranks passing K/V
blocks point to point, overlapped with the attention compute:

    seq_time(s, d) = alpha2*s/d + comm_bytes_per_token*s/d / bandwidth[u]
                     + max(alpha1*s^2/d,  ring_bytes_per_token*s*(r-1) / (r*min(u, kv_heads)) / ring_bandwidth)

``ring_bytes_per_token`` is the K+V bytes of one token over all layers, forward plus backward (the
backward passes K/V and their gradients: 3 passes); each rank holds ``1/min(u, kv_heads)`` of the
KV width after the Ulysses split (GQA kv heads are replicated, never split, below one per rank).

Constructors for the paper's presets and for a model + hardware description live in
``flexsp.presets`` and ``flexsp.analytic``; they all build this one object.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from solver.costs import DegreeCosts, seconds

from .cluster import is_power_of_two
from .errors import CostModelError

def _as_array(lengths: Iterable[int]) -> np.ndarray:
    return np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths), dtype=np.float64)


_COEFFICIENTS = ("alpha1", "alpha2", "beta1", "comm_bytes_per_token", "token_capacity")


@dataclass(frozen=True)
class CostModel:
    alpha1: float                       # s per token^2: attention, all layers, fwd+bwd, one GPU
    alpha2: float                       # s per token: everything linear in tokens
    beta1: float                        # s per group per micro-batch: fixed overhead
    comm_bytes_per_token: float         # all-to-all bytes per token over a whole step
    alltoall_bandwidth: Mapping[int, float]  # degree -> bytes/s
    token_capacity: float               # activation tokens one GPU can hold
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)  # provenance, free-form
    heads: int | None = None            # attention heads: sets the Ulysses limit (None: no limit)
    kv_heads: int | None = None         # KV heads (GQA); None: as many as heads
    ring_bytes_per_token: float = 0.0   # K+V bytes per token, all layers, fwd+bwd (ring axis)
    ring_bandwidth: float | None = None  # point-to-point bytes/s per GPU for the ring axis

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if value is None:
                raise CostModelError(f"cost model coefficient {name} is missing")
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise CostModelError(f"cost model coefficient {name} must be a number, got {value!r}") from None
            if not math.isfinite(value) or value < 0:
                raise CostModelError(f"cost model coefficient {name} must be finite and >= 0, got {value}")
            object.__setattr__(self, name, value)
        if self.token_capacity <= 0:
            raise CostModelError(f"token_capacity must be > 0, got {self.token_capacity}")
        if self.alpha1 == 0 and self.alpha2 == 0:
            raise CostModelError("alpha1 and alpha2 are both 0: every sequence would take no time")
        bandwidth: dict[int, float] = {}
        for degree, value in dict(self.alltoall_bandwidth or {}).items():
            degree = int(degree)
            if not is_power_of_two(degree):
                raise CostModelError(f"alltoall_bandwidth has degree {degree}, which is not a power of two")
            if value is None or not float(value) > 0 or not math.isfinite(float(value)):
                raise CostModelError(f"alltoall_bandwidth[{degree}] must be a finite number > 0, got {value!r}")
            bandwidth[degree] = float(value)
        object.__setattr__(self, "alltoall_bandwidth", dict(sorted(bandwidth.items())))
        object.__setattr__(self, "meta", dict(self.meta or {}))
        for name in ("heads", "kv_heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CostModelError(f"{name} must be a positive integer or None, got {value!r}")
        if self.heads is not None and self.kv_heads is not None and self.heads % self.kv_heads:
            raise CostModelError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not (math.isfinite(float(self.ring_bytes_per_token)) and self.ring_bytes_per_token >= 0):
            raise CostModelError(f"ring_bytes_per_token must be finite and >= 0, got {self.ring_bytes_per_token}")
        if self.ring_bandwidth is not None and not (math.isfinite(self.ring_bandwidth) and self.ring_bandwidth > 0):
            raise CostModelError(f"ring_bandwidth must be a finite number > 0, got {self.ring_bandwidth}")

    # --- time ---------------------------------------------------------------------------------
    def bandwidth(self, degree: int) -> float:
        if degree == 1:
            return math.inf
        try:
            return self.alltoall_bandwidth[degree]
        except KeyError:
            known = sorted(self.alltoall_bandwidth)
            raise CostModelError(
                f"no all-to-all bandwidth for SP degree {degree}; the cost model knows degrees {known}. "
                f"Add alltoall_bandwidth[{degree}] or keep plans below it") from None

    @property
    def ulysses_limit(self) -> int | None:
        """Largest Ulysses degree: the largest power of two dividing ``heads`` (None: unlimited)."""
        return None if self.heads is None else self.heads & -self.heads

    def split(self, degree: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) of a group of ``degree`` GPUs."""
        limit = self.ulysses_limit
        ulysses = degree if limit is None else min(degree, limit)
        return ulysses, degree // ulysses

    def coefficients(self, degree: int) -> tuple[float, float, float]:
        """(s^2, s, ring) coefficients of one sequence's time at ``degree`` (see the module docstring)."""
        if not is_power_of_two(int(degree)):
            raise CostModelError(f"SP degree must be a power of two, got {degree}")
        ulysses, ring = self.split(degree)
        comm = 0.0 if ulysses == 1 else self.comm_bytes_per_token / self.bandwidth(ulysses)
        ring_coefficient = 0.0
        if ring > 1:
            if self.ring_bandwidth is None:
                raise CostModelError(
                    f"SP degree {degree} exceeds the Ulysses limit of {self.ulysses_limit} ({self.heads} heads) and "
                    f"needs a ring axis: give ring_bandwidth (and ring_bytes_per_token), or keep plans within the "
                    f"limit (plan_batch(..., ulysses_only=True))")
            width = min(ulysses, self.kv_heads or ulysses)
            ring_coefficient = self.ring_bytes_per_token * (ring - 1) / (ring * width) / self.ring_bandwidth
        return self.alpha1 / degree, (self.alpha2 + comm) / degree, ring_coefficient

    def seq_time(self, length, degree: int):
        """Seconds for sequence(s) of ``length`` tokens in a group of ``degree`` GPUs (no beta1)."""
        out = seconds(length, *self.coefficients(degree))
        return float(out) if out.ndim == 0 else out

    def group_time(self, lengths: Iterable[int], degree: int) -> float:
        """Seconds for one group: its sequences one after another plus the fixed beta1."""
        return float(np.sum(self.seq_time(_as_array(lengths), degree))) + self.beta1

    # --- memory -------------------------------------------------------------------------------
    def group_capacity(self, degree: int) -> float:
        """Tokens a group of ``degree`` GPUs can hold."""
        return self.token_capacity * degree

    def fits(self, lengths: Iterable[int], degree: int) -> bool:
        return float(np.sum(_as_array(lengths))) <= self.group_capacity(degree)

    def min_degree(self, length: int) -> int:
        """Smallest power-of-two degree whose group holds ``length`` tokens alone."""
        need = max(1, math.ceil(length / self.token_capacity))
        return 1 << (need - 1).bit_length()

    # --- solver view --------------------------------------------------------------------------
    def degree_costs(self, degrees: Iterable[int]) -> DegreeCosts:
        degrees = tuple(sorted(set(int(d) for d in degrees)))
        quad, lin, ring = zip(*(self.coefficients(d) for d in degrees))
        return DegreeCosts(degrees=degrees, quad=quad, lin=lin, capacity=tuple(self.group_capacity(d) for d in degrees),
                           beta1=self.beta1, ring=ring)

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _COEFFICIENTS}
        out["alltoall_bandwidth"] = {str(d): bw for d, bw in self.alltoall_bandwidth.items()}
        out["meta"] = dict(self.meta)
        if self.heads is not None:
            out.update(heads=self.heads, kv_heads=self.kv_heads, ring_bytes_per_token=self.ring_bytes_per_token,
                       ring_bandwidth=self.ring_bandwidth)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        if not isinstance(data, Mapping):
            raise CostModelError(f"a cost model must be a JSON object, got {type(data).__name__}")
        missing = [k for k in (*_COEFFICIENTS, "alltoall_bandwidth") if k not in data]
        if missing:
            raise CostModelError(f"cost model is missing {', '.join(missing)}")
        bandwidth = data["alltoall_bandwidth"]
        if not isinstance(bandwidth, Mapping):
            raise CostModelError("alltoall_bandwidth must be an object mapping degree -> bytes/s")
        try:
            bandwidth = {int(d): v for d, v in bandwidth.items()}
        except ValueError:
            raise CostModelError(f"alltoall_bandwidth keys must be integer degrees, got {list(bandwidth)}") from None
        return cls(**{k: data[k] for k in _COEFFICIENTS}, alltoall_bandwidth=bandwidth,
                   meta=data.get("meta") or {}, heads=data.get("heads"), kv_heads=data.get("kv_heads"),
                   ring_bytes_per_token=data.get("ring_bytes_per_token") or 0.0,
                   ring_bandwidth=data.get("ring_bandwidth"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path} is not valid JSON: {exc}") from None
        except OSError as exc:
            raise CostModelError(f"cannot read cost model {path}: {exc}") from None
        return cls.from_dict(data)

    # --- constructors (thin wrappers so users find them on the class) -------------------------
    @classmethod
    def from_preset(cls, name: str, context: int = 384 * 1024, num_gpus: int = 64) -> "CostModel":
        from .presets import paper_preset
        return paper_preset(name, context=context, num_gpus=num_gpus)

    @classmethod
    def from_hardware(cls, model, gpu, num_gpus: int, gpus_per_node: int = 8, **kwargs) -> "CostModel":
        from .analytic import analytic_cost_model
        return analytic_cost_model(model, gpu, num_gpus=num_gpus, gpus_per_node=gpus_per_node, **kwargs)
