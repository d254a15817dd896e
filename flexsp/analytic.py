"""A cost model from a model and GPU description, for clusters nobody has profiled yet.

Formulas (bf16 training, fwd + bwd = 3x the forward FLOPs, FlashAttention so no s^2 memory):

* ``alpha1 = 3 * layers * 2 * hidden / (peak_flops * efficiency)`` seconds per token^2: causal
  attention does ``2 * s^2 * hidden`` FLOPs per layer forward (QK^T and AV, half the square each).
* ``alpha2 = 3 * 2 * P_linear / (peak_flops * efficiency)`` with ``P_linear`` the weights every
  token multiplies: per layer ``hidden * (hidden + 2 * kv_dim)`` (QKV) ``+ hidden^2`` (output)
  ``+ 3 * hidden * ffn`` (SwiGLU), plus ``hidden * vocab`` for the LM head.
* ``beta1``: a fixed per-group overhead (kernel launches, optimizer-free step bookkeeping), given.
* ``comm_bytes_per_token = 2 (fwd+bwd) * layers * (2 * hidden + 2 * kv_dim) * 2 bytes``: Ulysses
  moves Q, K, V in and the output back, K and V at their (GQA) width.
* Activation memory per token ``= 34 * hidden * layers`` bytes (Korthikanti et al. 2022 without
  the s^2 term; it gives 4.46 MB for GPT-7B, the paper measured 4.48 MB), or ``2 * hidden * layers``
  with full recomputation. Model states per GPU: ``flexsp.sharding.model_state_bytes`` (mixed-precision
  Adam as the runtime keeps it: ``"full"`` 16P/N, ``"grad_optim"`` 2P + 16P/N, ``"none"`` 18P).
  ``token_capacity = (memory * usable_fraction - model states) / activation bytes per token``.
* Beyond the Ulysses limit (``heads``), groups are Ulysses x ring hybrids (``flexsp.cost``): the
  ring passes K and V (``2 * kv_dim * 2`` bytes per token per layer) three times per step (forward,
  and K/V plus their gradients backward) at the inter-node point-to-point bandwidth.
* All-to-all bandwidth per degree ``d`` (bytes of a rank's payload per second): each rank keeps
  ``1/d`` of its payload and sends the rest. Inside a node all of it crosses NVLink:
  ``bw[d] = intra_bw * d / (d - 1)``. Across nodes (``d > g``, ``g`` GPUs per node), the share
  ``(d - g) / d`` leaves the node over the GPU's NIC while ``(g - 1) / d`` stays on NVLink, and the
  slower of the two sets the pace: ``bw[d] = 1 / max((d - g) / (d * inter_bw), (g - 1) / (d * intra_bw))``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .cost import CostModel
from .errors import CostModelError
from .sharding import check as check_sharding, from_zero_stage, model_state_bytes as _state_bytes


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    name: str = "custom"

    @property
    def params(self) -> float:
        kv_dim = self.hidden * self.kv_heads // self.heads
        per_layer = self.hidden * (self.hidden + 2 * kv_dim) + self.hidden * self.hidden + 3 * self.hidden * self.ffn
        return self.layers * per_layer + 2 * self.hidden * self.vocab

    @property
    def linear_params(self) -> float:
        """Weights each token multiplies (embedding lookup excluded, LM head included)."""
        return self.params - self.hidden * self.vocab


@dataclass(frozen=True)
class GPUSpec:
    peak_flops: float            # bf16 dense FLOP/s
    memory_bytes: float
    intra_node_bandwidth: float  # bytes/s per GPU that all-to-all achieves over NVLink
    inter_node_bandwidth: float  # bytes/s per GPU across nodes (its share of the node's NICs)
    efficiency: float = 0.5      # achieved / peak FLOP/s
    usable_memory: float = 0.9   # fraction left after the framework and fragmentation
    name: str = "custom"


MODELS = {
    "llama-7b": ModelSpec(32, 4096, 32, 32, 11008, 32000, "llama-7b"),
    "llama-13b": ModelSpec(40, 5120, 40, 40, 13824, 32000, "llama-13b"),
    "llama3-8b": ModelSpec(32, 4096, 32, 8, 14336, 128256, "llama3-8b"),
    "llama3-70b": ModelSpec(80, 8192, 64, 8, 28672, 128256, "llama3-70b"),
}
# Achieved, not nominal, bandwidths: the A100 entries reproduce the paper's cluster (all-to-all at
# ~100 GB/s inside a node, 400 Gb/s InfiniBand per 8-GPU node); H100 assumes one 400 Gb/s NIC per GPU.
GPUS = {
    "a100-40gb": GPUSpec(312e12, 40 * 2**30, 90e9, 6.25e9, name="a100-40gb"),
    "a100-80gb": GPUSpec(312e12, 80 * 2**30, 90e9, 6.25e9, name="a100-80gb"),
    "h100-80gb": GPUSpec(989e12, 80 * 2**30, 200e9, 40e9, name="h100-80gb"),
}


def alltoall_bandwidth(degree: int, gpus_per_node: int, intra: float, inter: float) -> float:
    if degree <= gpus_per_node:
        return intra * degree / (degree - 1)
    off_node = (degree - gpus_per_node) / (degree * inter)
    on_node = (gpus_per_node - 1) / (degree * intra)
    return 1.0 / max(off_node, on_node)


def model_state_bytes(params: float, zero_stage: int, num_gpus: int) -> float:
    """Model-state bytes per GPU by ZeRO stage (3, 2 or 0): ``flexsp.sharding.model_state_bytes``."""
    return _state_bytes(params, num_gpus, from_zero_stage(zero_stage))


def analytic_cost_model(model: ModelSpec | str, gpu: GPUSpec | str, num_gpus: int, gpus_per_node: int = 8, *,
                        sharding: str | None = None, zero_stage: int | None = None, beta1: float = 0.1,
                        recompute: bool = False) -> CostModel:
    """Cost model from FLOPs, bytes and bandwidths (formulas in the module docstring).

    ``sharding`` (``flexsp.sharding``: "full", "grad_optim", "none"; default "full") sets the model
    states the capacity leaves room for; ``zero_stage`` (3, 2, 0) is the older name for the same.
    """
    if sharding is not None and zero_stage is not None and from_zero_stage(zero_stage) != sharding:
        raise CostModelError(f"sharding={sharding!r} and zero_stage={zero_stage} disagree; give one")
    sharding = check_sharding(sharding if sharding is not None else
                              from_zero_stage(zero_stage) if zero_stage is not None else "full")
    if isinstance(model, str):
        if model not in MODELS:
            raise CostModelError(f"unknown model {model!r}; choose one of {sorted(MODELS)} or pass a ModelSpec")
        model = MODELS[model]
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise CostModelError(f"unknown GPU {gpu!r}; choose one of {sorted(GPUS)} or pass a GPUSpec")
        gpu = GPUS[gpu]
    for name, value in (("layers", model.layers), ("hidden", model.hidden), ("heads", model.heads),
                        ("kv_heads", model.kv_heads), ("ffn", model.ffn), ("vocab", model.vocab)):
        if value < 1:
            raise CostModelError(f"model {name} must be >= 1, got {value}")
    if model.heads % model.kv_heads:
        raise CostModelError(f"heads ({model.heads}) must be a multiple of kv_heads ({model.kv_heads})")
    for name in ("peak_flops", "memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth", "efficiency"):
        if not getattr(gpu, name) > 0:
            raise CostModelError(f"GPU {name} must be > 0, got {getattr(gpu, name)}")
    flops = gpu.peak_flops * gpu.efficiency
    kv_dim = model.hidden * model.kv_heads // model.heads
    act_per_token = (2 if recompute else 34) * model.hidden * model.layers
    free = gpu.memory_bytes * gpu.usable_memory - _state_bytes(model.params, num_gpus, sharding)
    if free <= act_per_token:
        raise CostModelError(f"{model.name} model states leave no activation memory on {num_gpus} x {gpu.name} "
                             f"with sharding {sharding!r}")
    degrees = [1 << i for i in range(1, int(math.log2(num_gpus)) + 1)] if num_gpus > 1 else []
    return CostModel(
        alpha1=3 * model.layers * 2 * model.hidden / flops,
        alpha2=3 * 2 * model.linear_params / flops,
        beta1=beta1,
        comm_bytes_per_token=2 * model.layers * (2 * model.hidden + 2 * kv_dim) * 2,
        alltoall_bandwidth={d: alltoall_bandwidth(d, gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
                            for d in degrees},
        token_capacity=math.floor(free / act_per_token),
        heads=model.heads,
        kv_heads=model.kv_heads,
        ring_bytes_per_token=3 * model.layers * 2 * kv_dim * 2,
        ring_bandwidth=gpu.inter_node_bandwidth,
        meta={"source": "analytic", "model": asdict(model), "gpu": asdict(gpu), "num_gpus": num_gpus,
              "gpus_per_node": gpus_per_node, "sharding": sharding, "recompute": recompute,
              "activation_bytes_per_token": act_per_token},
    )
