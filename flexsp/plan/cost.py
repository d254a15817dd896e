"""The paper's alpha-beta cost model (FlexSP Eqs. 11-14) and its token-capacity memory model.

    seq_time(s, d)   = (alpha1*s^2 + alpha2*s)/d + [d>1] * comm_bytes_per_token*s/d / bandwidth[d]
    group_time(S, d) = sum(seq_time(s, d) for s in S) + beta1
    fits(S, d)       = sum(S)/d <= token_capacity

Ulysses cannot split a sequence over more ranks than the model has attention heads, and its part must
divide them. When the model knows its ``heads``, a degree ``d`` is split by ``ulysses_split``: Ulysses
over ``u = gcd(d, heads)`` ranks (for a power of two ``d``: ``min(d, U)``, ``U`` the largest power of
two dividing ``heads``; for ``d = 6`` and 32 heads, ``u = 2``). Where ``u < d`` the group is costed as
the USP-style hybrid practitioners run: the all-to-all at ``bandwidth[u]`` on a ``s/d`` payload, times
a ring of ``r = d/u`` ranks (any size, 3 included) passing K/V blocks point to point, overlapped with
the attention compute:

    seq_time(s, d) = alpha2*s/d + comm_bytes_per_token*s/d / bandwidth[u]
                     + max(alpha1*s^2/d,  ring_bytes_per_token*s*(r-1) / (r*gcd(u, kv_heads)) / ring_bandwidth
                                          + (r-1) * ring_hop_latency)

``alltoall_replication[u]`` (default: none) scales ``comm_bytes_per_token`` at a Ulysses degree ``u`` where the
runtime copies heads before the all-to-all: a group wider than the model's kv heads gives every rank whole ones
(each kv head ``u / gcd(kv_heads, u)`` times), so K and V move that many times over (``flexsp.plan.analytic``
fills it from the model's heads; an older JSON file without it means what it did).

``ring_bytes_per_token`` is the K+V bytes of one token over all layers, forward plus backward (the
backward passes K/V and their gradients: 3 passes); each rank holds ``1/gcd(u, kv_heads)`` of the
KV width after the Ulysses split (GQA kv heads are replicated, never split, below one per rank).
``ring_hop_latency`` (default 0, so older JSON keeps its meaning) is the fixed cost of one hop of the
ring, summed over a step's layers and its three passes; a ring of ``r`` ranks makes ``r - 1`` hops.
``flexsp profile`` under torchrun measures both ring figures (``flexsp.profile.ring``: ``3 * layers``
times the fitted per-message latency); analytic models and the interconnect presets assume them.

Layer kinds (``flexsp.plan.layers``): a model with sliding-window or chunked layers adds, for each window
``w`` and chunk ``c``, ``window_alpha[w] * pairs_w(s)`` and ``chunk_alpha[c] * pairs_c(s)`` to the attention
term ``alpha1 * s^2`` (``alpha1`` then covers the full layers only; ``pairs`` is ``s^2`` below the window and
``w^2 + (s - w)(2w - 1)`` above it), divided by ``d`` and overlapped with the ring like it. Both tables are
empty by default, so every model and JSON file without them means what it did. The solver sees them through
``TermCosts``, a ``DegreeCosts`` whose ``seconds`` adds the terms (vectorised over lengths).

Constructors for the paper's presets and for a model + hardware description live in
``flexsp.plan.presets.cost_from_preset`` and ``flexsp.plan.analytic.cost_from_hardware``; they all build
this one object.

Every coefficient is checked when the model is built (a named ``CostModelError``, never a bare
exception), and so is the range of the times it can produce for the lengths it will see
(``check_range``): a user's unit slip (ms for s, MB for bytes) is refused before a solver divides
by a time that underflowed or sums times that overflowed. Capacities are integers of tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from flexsp.errors import CostModelError
from flexsp.inputs import exact_sum, integer, integer_keys, load_json, number, write_text
from flexsp.plan.cluster import ulysses_split
from flexsp.plan.layers import pairs
from flexsp.plan.lengths import as_lengths
from solver.types import DegreeCosts, seconds

MAX_GROUP_TOKENS = 2**52      # tokens one group may hold: float64 counts every sum of them exactly
MAX_SECONDS = 1e150           # longest time one group may take (times, sums and ratios stay finite)
MIN_SECONDS = 1e-150          # shortest time one token may take
MIN_SHARE_OF_BETA1 = 2.0**-40  # ... relative to beta1, so that beta1 + t != beta1 in float64

def _as_array(lengths: Iterable[int]) -> np.ndarray:
    return np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths), dtype=np.float64)


_COEFFICIENTS = ("alpha1", "alpha2", "beta1", "comm_bytes_per_token", "token_capacity")
_TERMS = ("window_alpha", "chunk_alpha")    # per-size attention terms of windowed / chunked layers


MAX_BANDWIDTH_DEGREES = 2**16  # entries an alltoall_bandwidth table may have (every degree of 16,384 GPUs: 2,055)


def _degree_keys(table: Mapping[Any, Any]) -> dict[int, Any]:
    """alltoall_bandwidth by degree: its keys positive integer SP degrees (any size: 3, 6, 24 ...), or their
    decimal strings (JSON keys are strings), each degree once (``flexsp.inputs.integer_keys``)."""
    out = integer_keys(table, "alltoall_bandwidth", CostModelError, "integer SP degree")
    for degree in out:
        if not 1 <= degree <= 2**40:
            raise CostModelError(f"alltoall_bandwidth has degree {degree}, which is not an SP degree (1 to 2**40 GPUs)")
    return out


def _number_table(table: Any, name: str, key: str, value: str, key_name: str) -> dict[int, float]:
    """A ``{whole number: number}`` field (``window_alpha``, ``chunk_alpha``, ``alltoall_replication``): None is
    empty; keys as ``integer_keys`` reads them (JSON's decimal strings), values checked numbers."""
    if table is None:
        return {}
    if not isinstance(table, Mapping):
        raise CostModelError(f"{name} must map a {key} -> {value}, got {type(table).__name__}")
    return {k: number(v, f"{name}[{k}]", CostModelError)
            for k, v in integer_keys(table, name, CostModelError, key_name).items()}


@dataclass(frozen=True)
class CostModel:
    alpha1: float                       # s per token^2: attention of the full layers (all, without kinds), fwd+bwd, one GPU
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
    ring_hop_latency: float = 0.0       # s of latency per ring hop, summed over a step's layers and passes
    window_alpha: Mapping[int, float] = field(default_factory=dict)  # window w -> s per pair of its layers
    chunk_alpha: Mapping[int, float] = field(default_factory=dict)   # chunk c -> s per pair of its layers
    alltoall_replication: Mapping[int, float] = field(default_factory=dict)  # Ulysses degree -> volume x (>= 1)

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if value is None:
                raise CostModelError(f"cost model coefficient {name} is missing")
            object.__setattr__(self, name, number(value, f"cost model coefficient {name}", CostModelError))
        if self.token_capacity < 1:
            raise CostModelError(f"token_capacity must be >= 1 token per GPU, got {self.token_capacity}")
        if self.token_capacity > MAX_GROUP_TOKENS:
            raise CostModelError(f"token_capacity {self.token_capacity:.6g} is above 2**52 tokens per GPU, more than "
                                 f"the planner counts exactly; give the activation tokens one GPU holds")
        table = self.alltoall_bandwidth if self.alltoall_bandwidth is not None else {}
        if not isinstance(table, Mapping):
            raise CostModelError(f"alltoall_bandwidth must map SP degree -> bytes/s, got {type(table).__name__}")
        if len(table) > MAX_BANDWIDTH_DEGREES:
            raise CostModelError(f"alltoall_bandwidth has {len(table)} degrees, more than the {MAX_BANDWIDTH_DEGREES} a "
                                 f"cost model may list")
        bandwidth = {degree: number(value, f"alltoall_bandwidth[{degree}]", CostModelError, positive=True)
                     for degree, value in _degree_keys(table).items()}
        object.__setattr__(self, "alltoall_bandwidth", dict(sorted(bandwidth.items())))
        if self.meta is not None and not isinstance(self.meta, Mapping):
            raise CostModelError(f"meta must be a mapping (a JSON object) of provenance, got {type(self.meta).__name__}")
        object.__setattr__(self, "meta", dict(self.meta or {}))
        for name in ("heads", "kv_heads"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, integer(value, f"{name} (attention heads; or None)", CostModelError,
                                                       maximum=2**31))
        if self.heads is not None and self.kv_heads is not None and self.heads % self.kv_heads:
            raise CostModelError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        object.__setattr__(self, "ring_bytes_per_token",
                           number(self.ring_bytes_per_token, "ring_bytes_per_token", CostModelError))
        object.__setattr__(self, "ring_hop_latency",
                           number(self.ring_hop_latency, "ring_hop_latency (seconds)", CostModelError))
        if self.ring_bandwidth is not None:
            object.__setattr__(self, "ring_bandwidth", number(self.ring_bandwidth, "ring_bandwidth (bytes/s, or None)",
                                                              CostModelError, positive=True))
        for name in _TERMS:
            checked = _number_table(getattr(self, name), name, "size in tokens", "seconds per attention pair", "token size")
            for size in checked:
                if size < 1:
                    raise CostModelError(f"{name} has size {size}; sizes are whole numbers of tokens >= 1")
            object.__setattr__(self, name, dict(sorted(checked.items())))
        checked = _number_table(self.alltoall_replication, "alltoall_replication", "Ulysses degree",
                                "a volume factor >= 1", "Ulysses degree")
        for degree, factor in checked.items():
            if not (2 <= degree <= 2**40 and 1 <= factor <= 2**20):
                raise CostModelError(f"alltoall_replication[{degree}] = {factor!r}: a Ulysses degree 2 to 2**40 maps to "
                                     f"how many times the all-to-all volume is comm_bytes_per_token's (1 to 2**20)")
        object.__setattr__(self, "alltoall_replication", dict(sorted(checked.items())))
        if self.alpha1 == 0 and self.alpha2 == 0 and not any(self.terms_alpha()):
            raise CostModelError("alpha1 and alpha2 are both 0: every sequence would take no time")
        self.check_range(d for d in (1, *self.alltoall_bandwidth) if self.split(d)[1] == 1 or self.ring_bandwidth)

    def check_range(self, degrees: Iterable[int]) -> None:
        """Raise ``CostModelError`` unless every time this model gives at these degrees is representable.

        A group of degree ``d`` sees 1 to ``token_capacity * d`` tokens. Its capacity must be at most
        2**52 tokens (float64 counts it exactly), the time of a full group at most 1e150 s (sums and
        ratios of times then stay finite), and one token's time at least 1e-150 s and at least 2**-40
        of ``beta1`` (a smaller time vanishes when added to the per-group overhead).
        """
        for degree in degrees:
            tokens = self.token_capacity * degree
            if tokens > MAX_GROUP_TOKENS:
                raise CostModelError(
                    f"a group of {degree} GPUs holds token_capacity x {degree} = {tokens:.6g} tokens, above 2**52, "
                    f"more than the planner counts exactly; lower token_capacity or the largest SP degree")
            quad, lin, ring = self.coefficients(degree)
            full = float(math.floor(tokens))
            longest = float(self.seq_time(full, degree)) + self.beta1
            if not longest <= MAX_SECONDS:
                raise CostModelError(
                    f"a group of {degree} GPUs at its capacity of {full:.0f} tokens would take {longest:.3g} s, above "
                    f"{MAX_SECONDS:.0e} s: alpha1/alpha2 are seconds per token^2 / per token, comm_bytes_per_token "
                    f"bytes and bandwidths bytes/s; check their units")
            shortest = lin + max(quad + sum(self.terms_alpha()) / degree, ring)
            if not (shortest >= MIN_SECONDS and shortest >= self.beta1 * MIN_SHARE_OF_BETA1):
                raise CostModelError(
                    f"one token in a group of {degree} GPUs takes {shortest:.3g} s, which vanishes beside "
                    f"beta1 = {self.beta1:.3g} s (a sequence's time must be at least {MIN_SECONDS:.0e} s and "
                    f"2**-40 of beta1); check the units of alpha1, alpha2 and beta1")

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

    def alltoall_bytes(self, ulysses: int) -> float:
        """All-to-all bytes per token over a step at Ulysses degree ``ulysses``: ``comm_bytes_per_token``, times
        ``alltoall_replication`` where the runtime copies heads to give every rank whole ones."""
        return self.comm_bytes_per_token * self.alltoall_replication.get(ulysses, 1.0)

    @property
    def ulysses_limit(self) -> int | None:
        """Largest Ulysses degree: the largest power of two dividing ``heads`` (None: unlimited)."""
        return None if self.heads is None else self.heads & -self.heads

    def split(self, degree: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) of a group of ``degree`` GPUs."""
        return ulysses_split(degree, self.heads)

    def coefficients(self, degree: int) -> tuple[float, float, float]:
        """(s^2, s, ring) coefficients of one sequence's time at ``degree`` (see the module docstring)."""
        if isinstance(degree, (bool, np.bool_)) or not isinstance(degree, (int, np.integer)) or degree < 1:
            raise CostModelError(f"SP degree must be a whole number >= 1, got {degree!r}")
        ulysses, ring = self.split(degree)
        comm = 0.0 if ulysses == 1 else self.alltoall_bytes(ulysses) / self.bandwidth(ulysses)
        ring_coefficient = 0.0
        if ring > 1:
            if self.ring_bandwidth is None:
                raise CostModelError(
                    f"SP degree {degree} exceeds the Ulysses limit of {ulysses} for {self.heads} heads (Ulysses takes "
                    f"gcd(degree, heads), a ring of {ring} the rest) and needs a ring axis, which this model has none of (a model "
                    f"with linear-attention layers never has one): keep plans within the limit (plan_batch(..., "
                    f"ulysses_only=True), or degrees up to {self.ulysses_limit}), or give ring_bandwidth and ring_bytes_per_token")
            # each rank holds 1/gcd(u, kv_heads) of the K/V width: kv heads are copied to whole ones per rank
            width = math.gcd(ulysses, self.kv_heads) if self.kv_heads else ulysses
            ring_coefficient = self.ring_bytes_per_token * (ring - 1) / (ring * width) / self.ring_bandwidth
        return self.alpha1 / degree, (self.alpha2 + comm) / degree, ring_coefficient

    def costs_degree(self, degree: int) -> bool:
        """Whether this model can cost ``degree``: the all-to-all bandwidth of its Ulysses part is known,
        and the ring bandwidth where its split needs a ring (``PlanConfig(degrees="any")`` keeps only these)."""
        try:
            self.coefficients(degree)
        except CostModelError:
            return False
        return True

    def ring_hops(self, degree: int) -> float:
        """Seconds of ring latency per sequence at ``degree``: ``(r - 1) * ring_hop_latency`` for a ring of
        ``r`` ranks (a block passes ``r - 1`` hops per pass; ``ring_hop_latency`` already sums a step's
        layers and passes), 0 without a ring axis. Overlapped with attention like the bandwidth term."""
        ring = self.split(degree)[1]
        return (ring - 1) * self.ring_hop_latency if ring > 1 else 0.0

    # --- layer kinds (flexsp.plan.layers) -------------------------------------------------------
    @property
    def terms(self) -> tuple[tuple[str, int], ...]:
        """The attention terms beyond ``alpha1 * s^2``: ``("window", w)`` and ``("chunk", c)``, in a fixed order."""
        return tuple(("window", w) for w in self.window_alpha) + tuple(("chunk", c) for c in self.chunk_alpha)

    def terms_alpha(self) -> tuple[float, ...]:
        """Seconds per attention pair (one GPU) of each of ``terms``."""
        return (*self.window_alpha.values(), *self.chunk_alpha.values())

    def attention_seconds(self, length, degree: int = 1):
        """Seconds of attention compute of sequence(s) of ``length`` tokens at ``degree`` (vectorised):
        ``(alpha1 s^2 + sum over windows and chunks of alpha x pairs(s)) / degree``."""
        s = np.asarray(length, dtype=np.float64)
        out = self.alpha1 * s * s
        for (mixer, size), alpha in zip(self.terms, self.terms_alpha()):
            out = out + alpha * pairs(s, mixer, size)
        return out / degree

    def seq_time(self, length, degree: int):
        """Seconds for sequence(s) of ``length`` tokens in a group of ``degree`` GPUs (no beta1)."""
        if not self.terms:
            out = seconds(length, *self.coefficients(degree), self.ring_hops(degree))
        else:
            _, lin, ring = self.coefficients(degree)
            s = np.asarray(length, dtype=np.float64)
            out = lin * s + np.maximum(self.attention_seconds(s, degree), ring * s + self.ring_hops(degree))
        return float(out) if out.ndim == 0 else out

    def group_time(self, lengths: Iterable[int], degree: int) -> float:
        """Seconds for one group: its sequences one after another plus the fixed beta1."""
        return float(np.sum(self.seq_time(_as_array(lengths), degree))) + self.beta1

    # --- memory -------------------------------------------------------------------------------
    def group_capacity(self, degree: int) -> int:
        """Tokens a group of ``degree`` GPUs can hold, as an integer (lengths are compared exactly)."""
        return math.floor(self.token_capacity * degree)   # exact for whole-token capacities; the one rule validate uses too

    def fits(self, lengths: Iterable[int], degree: int) -> bool:
        return exact_sum(as_lengths(lengths)) <= self.group_capacity(degree)

    def min_degree(self, length: int) -> int:
        """Smallest power-of-two degree whose group holds ``length`` tokens alone."""
        length = integer(length, "length", CostModelError)
        degree = 1
        while self.group_capacity(degree) < length:
            degree *= 2
        return degree

    @property
    def activation_bytes_per_token(self) -> float | None:
        """Activation bytes one token takes on a GPU, where the model records it: ``meta`` key
        ``activation_bytes_per_token`` (presets, analytic) or a profile's ``meta["memory"]["bytes_per_token"]``."""
        value = self.meta.get("activation_bytes_per_token")
        if value is None and isinstance(self.meta.get("memory"), Mapping):
            value = self.meta["memory"].get("bytes_per_token")
        return None if value is None else number(value, "meta activation_bytes_per_token", CostModelError,
                                                 positive=True)

    # --- solver view --------------------------------------------------------------------------
    def degree_costs(self, degrees: Iterable[int]) -> DegreeCosts:
        degrees = tuple(sorted(set(int(d) for d in degrees)))
        self.check_range(degrees)
        quad, lin, ring = zip(*(self.coefficients(d) for d in degrees))
        common = dict(degrees=degrees, quad=quad, lin=lin, capacity=tuple(float(self.group_capacity(d)) for d in degrees),
                      beta1=self.beta1, ring=ring, hops=tuple(self.ring_hops(d) for d in degrees))
        if not self.terms:
            return DegreeCosts(**common)
        return TermCosts(**common, terms=self.terms,
                         weights=tuple(tuple(a / d for d in degrees) for a in self.terms_alpha()))

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _COEFFICIENTS}
        out["alltoall_bandwidth"] = {str(d): bw for d, bw in self.alltoall_bandwidth.items()}
        out["meta"] = dict(self.meta)
        for name, default in (("heads", None), ("kv_heads", None), ("ring_bytes_per_token", 0.0),
                              ("ring_bandwidth", None), ("ring_hop_latency", 0.0)):
            if getattr(self, name) != default:      # written when set, so every model round-trips exactly
                out[name] = getattr(self, name)
        for name in (*_TERMS, "alltoall_replication"):   # written when a model has windowed or chunked layers, or
            if getattr(self, name):                       # copies heads for the all-to-all
                out[name] = {str(key): value for key, value in getattr(self, name).items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostModel":
        if not isinstance(data, Mapping):
            raise CostModelError(f"a cost model must be a JSON object, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise CostModelError(f"cost model has unknown keys {unknown} (a typo?); valid keys: {', '.join(known)}")
        missing = [k for k in (*_COEFFICIENTS, "alltoall_bandwidth") if k not in data]
        if missing:
            raise CostModelError(f"cost model is missing {', '.join(missing)}")
        if not isinstance(data["alltoall_bandwidth"], Mapping):
            raise CostModelError("alltoall_bandwidth must be an object mapping degree -> bytes/s")
        values = dict(data)
        if values.get("ring_bytes_per_token") is None:
            values["ring_bytes_per_token"] = 0.0
        return cls(**values)

    def save(self, path: str | Path) -> None:
        try:
            text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CostModelError(f"cost model meta cannot be written as JSON: {exc}") from None
        write_text(path, text, "cost model", CostModelError)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        return load_json(path, "cost model", CostModelError, cls.from_dict)


@dataclass(frozen=True)
class TermCosts(DegreeCosts):
    """``DegreeCosts`` of a model with windowed or chunked layers: the solver's one view of the cost, its
    ``seconds`` adding each term's ``weights[j][k] * pairs(s)`` (``flexsp.plan.layers.pairs``) to the
    ``quad * s^2`` attention. Every solver step evaluates time through ``seconds`` (``times``, ``seq_time``,
    ``group_time``, ``group_loads``), so the solver plans on plain numbers as before, vectorised over lengths."""

    terms: tuple[tuple[str, int], ...] = ()
    weights: tuple[tuple[float, ...], ...] = ()   # per term, per degree: seconds per attention pair

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.weights) != len(self.terms) or any(len(w) != len(self.degrees) for w in self.weights):
            raise ValueError("TermCosts needs one weight per term and degree")
        object.__setattr__(self, "_weights", np.asarray(self.weights, dtype=np.float64).reshape(
            len(self.terms), len(self.degrees)))

    def seconds(self, lengths, k) -> np.ndarray:
        s = np.asarray(lengths, dtype=np.float64)
        attention = self._quad[k] * s * s
        for (mixer, size), weight in zip(self.terms, self._weights):
            attention = attention + weight[k] * pairs(s, mixer, size)
        return self._lin[k] * s + np.maximum(attention, self._ring[k] * s + self._hops[k])


def describe_sources(cost: CostModel) -> str:
    """One line: which parts of ``cost`` were measured on this hardware and which are assumed or
    estimated, from its ``meta`` (``flexsp profile`` records both; presets and analytic models say
    where their constants come from). ``flexsp simulate`` prints it under the cost model's name.

    ``meta`` is free-form provenance from a file nobody checked field by field: a field of the wrong shape
    makes the line say so instead of raising (the coefficients, which planning uses, were checked)."""
    try:
        return _describe_sources(cost.meta)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        return "cost model parts: provenance unreadable (a field of the file's meta has the wrong shape)"


def _describe_sources(meta: Mapping[str, Any]) -> str:
    source = meta.get("source")
    if source == "flexsp profile":
        estimates = list(meta.get("estimates", []))
        measured = ["compute (alpha1, alpha2, beta1)"]
        if not any(e.startswith(("activation memory", "device memory")) for e in estimates):
            measured.append("memory")
        fits = sorted(int(d) for d in (meta.get("comm") or {}).get("fits", {}))
        if fits:
            measured.append(f"all-to-all at degrees {fits}")
        ring = meta.get("ring") or {}
        if ring.get("measured"):
            measured.append(f"ring bandwidth and hop latency (rings of {ring.get('ring', '?')}, {ring.get('link', '?')})")
        assumed = meta.get("assumed") or {}
        if assumed:
            estimates = [e for e in estimates if not e.startswith("interconnect")]
            parts = assumed.get("parts", ["alltoall_bandwidth", "ring_bandwidth"])
            what = ", ".join([f"all-to-all at degrees {assumed['degrees'][0]}..{assumed['degrees'][-1]}"] * bool(
                assumed["degrees"]) + ["ring bandwidth and hop latency"] * ("ring_bandwidth" in parts))
            if what:
                estimates.append(f"{what} from the {assumed['interconnect']} preset")
        line = f"cost model parts: measured {', '.join(measured)}; assumed {'; '.join(estimates) or 'nothing'}"
        provenance = meta.get("provenance")      # a measured preset (flexsp.plan.measured_presets) says where from
        if isinstance(provenance, Mapping) and provenance.get("summary"):
            line += f"\nmeasured preset {meta.get('preset')}: {provenance['summary']}"
            if meta.get("context_note"):
                line += f" ({meta['context_note']})"
        return line
    if source == "analytic":
        line = "cost model parts: assumed throughout (analytic: datasheet FLOP/s and bandwidths, 5 us per ring hop)"
        model = meta.get("model") if isinstance(meta.get("model"), Mapping) else {}
        kinds = model.get("layer_kinds")
        if isinstance(kinds, Mapping) and kinds:        # flexsp.plan.specs.ModelSpec.shape of a model with kinds
            line += "\nlayers: " + ", ".join(f"{n} {k}" for k, n in kinds.items())
            if model.get("active_params") and model.get("params"):
                line += (f"; {model['active_params'] / 1e9:.1f} B of {model['params'] / 1e9:.1f} B parameters "
                         f"active per token")
        return line
    if meta.get("preset"):
        return (f"cost model parts: the published constants of preset {meta['preset']} (measured by the FlexSP paper on "
                "its A100 cluster, not on this hardware)")
    return "cost model parts: custom, provenance not recorded"
