"""A Megatron-LM-style baseline for the paper's comparison: tensor parallel inside a node plus
context parallel (ring attention) across nodes, one fixed CP size for the whole batch.

It is not a ``Plan`` of SP groups: Megatron runs ``R = N / (tp * cp)`` identical model replicas
(data parallel), each a ``tp x cp`` block of GPUs that processes its share of the batch as packed
micro-batches one after another. This module turns a batch of lengths into that step's time.

Per sequence of ``s`` tokens on a ``tp x cp`` replica (``t = tp``, ``c = cp``, ``L`` layers,
``h`` hidden, 2-byte activations; all times are for fwd + bwd over all layers):

- compute (ideal split over ``t * c`` GPUs, the paper's alpha constants)::

      linear    = alpha2 * s / (t * c)
      attention = alpha1 * s^2 / (t * c)

- TP: per layer 2 all-reduces in the forward and 2 in the backward, each moving
  ``2 * (t-1)/t * (s/c) * h * 2`` bytes per GPU over the intra-node bandwidth, not overlapped::

      tp_comm = 4 * L * 2 * (t-1)/t * (s/c) * h * 2 / intra_node_bandwidth

- CP ring attention: ``c`` ring steps, each computing ``attention / c``; the ``c - 1`` steps that
  receive a K/V block overlap it with the compute (``max(compute, comm)`` per step). A K/V block is
  ``2 * kv_dim * (s/c) * 2`` bytes with ``kv_dim = h / t`` (each GPU holds ``1/t`` of the heads);
  the forward passes K/V once, the backward passes K/V again plus dK/dV, so 3 blocks per layer::

      step_compute = attention / c
      step_comm    = 3 * L * 2 * (h/t) * (s/c) * 2 / cp_bandwidth
      attention_time = step_compute + (c - 1) * max(step_compute, step_comm)

  ``cp_bandwidth`` is the inter-node bandwidth per GPU when the replica spans nodes
  (``t * c > gpus_per_node``), else the intra-node one. (Computing ``max`` on the totals over layers
  and passes equals the per-layer, per-pass sum because every layer is alike and fwd/bwd compute and
  traffic are both in the ratio 1:2.)

- ``seq_time = linear + tp_comm + attention_time``; a micro-batch (a pack of sequences) costs the
  sum of its sequences plus ``beta1``; a pack fits when ``tokens / (t * c) <= token_capacity``
  (Megatron's sequence parallelism shards every activation over TP, CP shards over tokens).

The step: for every feasible power-of-two CP size (the longest sequence fits one replica), the
sequences go longest-time first to the replica whose estimated time grows least (LPT; the
estimate counts ``beta1`` per ``ceil(tokens / capacity)`` packs), each replica packs its sequences
first-fit decreasing into micro-batches, and the step takes as long as the slowest replica
(replicas only meet at the gradient all-reduce). The best CP size of the batch is reported.

Assumptions, all favourable to the baseline (so our speedups over it are conservative): the same
per-GPU activation budget as the FlexSP presets (Megatron's model states are larger with TP than
ZeRO-3's), ideal compute split, replicas may run different numbers of micro-batches, and the
inter-node bandwidth defaults to the nominal 400 Gb/s per node shared by its 8 GPUs (6.25e9 B/s per
GPU, above the paper's measured 5.1e9 B/s all-to-all at 64 GPUs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from flexsp.errors import CostModelError, PlanError
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import as_lengths
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.specs import get_model

# 400 Gb/s InfiniBand per node (the paper's cluster) shared by 8 GPUs, in bytes/s per GPU.
NOMINAL_INTER_NODE_BANDWIDTH = 400e9 / 8 / 8


@dataclass(frozen=True)
class MegatronModel:
    """Time and memory of one sequence on a ``tp x cp`` Megatron replica (formulas in the module doc)."""

    alpha1: float                   # s per token^2: attention, all layers, fwd+bwd, one GPU
    alpha2: float                   # s per token: everything linear in tokens, one GPU
    beta1: float                    # s per micro-batch: fixed overhead
    hidden: int
    layers: int
    token_capacity: float           # activation tokens one GPU holds
    intra_node_bandwidth: float     # bytes/s per GPU for NVLink collectives
    inter_node_bandwidth: float     # bytes/s per GPU for ring P2P across nodes
    tp: int = 8
    gpus_per_node: int = 8
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        for name in ("alpha1", "alpha2", "beta1", "token_capacity", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0 or (name != "beta1" and name.endswith(("bandwidth", "capacity")) and value == 0):
                raise CostModelError(f"MegatronModel.{name} must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("hidden", "layers", "tp", "gpus_per_node", "bytes_per_element"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CostModelError(f"MegatronModel.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.tp:
            raise CostModelError(f"hidden={self.hidden} must be divisible by tp={self.tp} (heads split over TP)")

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def from_cost_model(cls, cost: CostModel, hidden: int, layers: int, *, tp: int = 8, gpus_per_node: int = 8,
                        inter_node_bandwidth: float = NOMINAL_INTER_NODE_BANDWIDTH) -> "MegatronModel":
        """Same compute constants and activation budget as ``cost``; intra-node bandwidth is its
        all-to-all bandwidth at one node's degree (the paper's NVLink measurement). Megatron's model has one
        attention term, ``alpha1 s^2``: a cost model with windowed or chunked layers is refused."""
        if cost.terms:
            raise CostModelError("MegatronModel costs every layer as full attention (alpha1 s^2); this cost model has "
                                 f"windowed or chunked layers ({', '.join(f'{m} {n}' for m, n in cost.terms)})")
        try:
            intra = cost.alltoall_bandwidth[gpus_per_node]
        except KeyError:
            raise CostModelError(f"the cost model has no bandwidth for degree {gpus_per_node} (one node)") from None
        return cls(alpha1=cost.alpha1, alpha2=cost.alpha2, beta1=cost.beta1, hidden=hidden, layers=layers,
                   token_capacity=cost.token_capacity, intra_node_bandwidth=intra,
                   inter_node_bandwidth=inter_node_bandwidth, tp=tp, gpus_per_node=gpus_per_node)

    @classmethod
    def from_preset(cls, name: str, context: int = 384 * 1024, num_gpus: int = 64, **kwargs) -> "MegatronModel":
        """The paper's GPT preset (``flexsp.plan.presets``) seen by Megatron."""
        cost = cost_from_preset(name, context=context, num_gpus=num_gpus)
        model = get_model(name)
        return cls.from_cost_model(cost, model.hidden, model.layers, **kwargs)

    # --- one sequence -------------------------------------------------------------------------
    def replica_gpus(self, cp: int) -> int:
        return self.tp * cp

    def capacity(self, cp: int) -> float:
        """Tokens one micro-batch of a ``tp x cp`` replica can hold."""
        return self.token_capacity * self.tp * cp

    def cp_bandwidth(self, cp: int) -> float:
        return self.inter_node_bandwidth if self.tp * cp > self.gpus_per_node else self.intra_node_bandwidth

    def breakdown(self, length, cp: int) -> dict[str, np.ndarray | float]:
        """Each term of ``seq_time`` for sequence(s) of ``length`` tokens (seconds)."""
        if not isinstance(cp, (int, np.integer)) or cp < 1 or cp & (cp - 1):
            raise CostModelError(f"cp must be a power of two >= 1, got {cp!r}")
        s = np.asarray(length, dtype=np.float64)
        t, b = self.tp, self.bytes_per_element
        gpus = t * cp
        local = s / cp
        linear = self.alpha2 * s / gpus
        attention = self.alpha1 * s * s / gpus
        tp_comm = (4 * self.layers * 2 * (t - 1) / t * local * self.hidden * b / self.intra_node_bandwidth
                   if t > 1 else np.zeros_like(s))
        step_compute = attention / cp
        step_comm = 3 * self.layers * 2 * (self.hidden // t) * local * b / self.cp_bandwidth(cp)
        attention_time = step_compute + (cp - 1) * np.maximum(step_compute, step_comm)
        return {"linear": linear, "attention": attention_time, "tp_comm": tp_comm,
                "ring_comm_exposed": attention_time - attention, "ring_step_compute": step_compute,
                "ring_step_comm": step_comm if cp > 1 else np.zeros_like(s)}

    def seq_time(self, length, cp: int):
        """Seconds for sequence(s) of ``length`` tokens on one ``tp x cp`` replica (no beta1)."""
        parts = self.breakdown(length, cp)
        out = parts["linear"] + parts["tp_comm"] + parts["attention"]
        return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class MegatronStep:
    """One step of the Megatron baseline: the chosen CP size and what every CP size would cost."""

    time: float                          # seconds, at the best CP size
    cp: int
    replicas: int
    micro_batches: tuple[int, ...]       # per replica, at the best CP size
    times_by_cp: dict[int, float] = field(default_factory=dict)   # inf where infeasible


def _first_fit_decreasing(tokens: np.ndarray, capacity: float) -> int:
    """Number of packs (micro-batches) first-fit decreasing needs."""
    free: list[float] = []
    for x in np.sort(tokens)[::-1]:
        for i, room in enumerate(free):
            if room >= x:
                free[i] -= x
                break
        else:
            free.append(capacity - x)
    return len(free)


def step_for_cp(lengths: np.ndarray, model: MegatronModel, num_gpus: int, cp: int) -> tuple[float, tuple[int, ...]]:
    """Step time and micro-batches per replica at one CP size (``inf`` when it cannot hold the batch)."""
    replicas = num_gpus // model.replica_gpus(cp)
    capacity = model.capacity(cp)
    if replicas < 1 or lengths.max() > capacity:
        return math.inf, ()
    times = np.asarray(model.seq_time(lengths, cp), dtype=np.float64)
    # LPT on the estimated replica time: sequence times plus beta1 per ceil(tokens / capacity) packs
    seq_sum = np.zeros(replicas)
    tok_sum = np.zeros(replicas)
    owner = np.empty(len(lengths), dtype=np.int64)
    for i in np.lexsort((-lengths, -times)):
        estimate = seq_sum + times[i] + model.beta1 * np.ceil((tok_sum + lengths[i]) / capacity - 1e-12)
        r = int(np.argmin(estimate))          # ties: the lowest replica index
        owner[i] = r
        seq_sum[r] += times[i]
        tok_sum[r] += lengths[i]
    packs = tuple(_first_fit_decreasing(lengths[owner == r], capacity) for r in range(replicas))
    replica_time = seq_sum + model.beta1 * np.asarray(packs)
    return float(replica_time.max()), packs


def megatron_step_time(lengths: Iterable[int] | np.ndarray, model: MegatronModel, num_gpus: int,
                       cp: int | None = None) -> MegatronStep:
    """The Megatron-style step time of one global batch at CP size ``cp``, or at the best power of
    two (feasible: the longest sequence fits one ``tp x cp`` replica and ``tp * cp <= num_gpus``)."""
    lengths = as_lengths(lengths)
    if num_gpus % model.tp:
        raise PlanError(f"num_gpus={num_gpus} must be a multiple of tp={model.tp}")
    sizes, size = [], 1
    while model.tp * size <= num_gpus:
        sizes.append(size)
        size *= 2
    if cp is not None:
        if cp not in sizes:
            raise PlanError(f"cp={cp} must be a power of two with tp * cp <= {num_gpus}; choose one of {sizes}")
        sizes = [cp]
    results = {c: step_for_cp(lengths, model, num_gpus, c) for c in sizes}
    times = {c: r[0] for c, r in results.items()}
    best = min(times, key=lambda c: (times[c], c))
    if not math.isfinite(times[best]):
        raise PlanError(f"a sequence of {int(lengths.max())} tokens fits no Megatron replica: tp={model.tp} x "
                        f"cp<={sizes[-1]} GPUs hold {model.capacity(sizes[-1]):.0f} tokens")
    return MegatronStep(time=times[best], cp=best, replicas=num_gpus // model.replica_gpus(best),
                        micro_batches=results[best][1], times_by_cp=times)


__all__ = ["MegatronModel", "MegatronStep", "megatron_step_time", "step_for_cp", "NOMINAL_INTER_NODE_BANDWIDTH"]
