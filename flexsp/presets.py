"""The paper's published cost-model constants for GPT-7B/13B/30B on 64 x A100-40GB (docs/design.md, "Cost model").

Times were published in ms and memory in MB; we store seconds and bytes. Bandwidths are in the
reference's "MB per ms" (a time in ms is MB / v), so bytes/s = v * 2**20 * 1000. The memory model:
``token_capacity = floor((30 GB - model states) / activation MB per token)`` with model states from
``flexsp.sharding`` (default ``"full"``, ZeRO-3: ``params * 16 bytes / N``, the paper's setting).
Parameters were published at 192K and 384K context only; other contexts interpolate linearly between the two (labelled in ``meta``). The bandwidth table stops at 64 GPUs;
bigger clusters reuse the 64-GPU value for every larger degree (inter-node all-to-all bandwidth per
GPU flattens once most peers are off-node), also labelled in ``meta``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel
from .errors import CostModelError
from .sharding import check as check_sharding, model_state_bytes

MB = 2**20
MEMORY_LIMIT_MB = 30 * 1024
PAPER_BANDWIDTH_MB_PER_MS = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


@dataclass(frozen=True)
class PaperModel:
    act_mb_per_token: float
    alpha1_ms: float
    alpha2_ms: float
    beta1_ms: float
    hidden: int
    layers: int
    params_b_192k: float
    params_b_384k: float

    def params_b(self, context: int) -> float:
        lo, hi = 192 * 1024, 384 * 1024
        return self.params_b_192k + (self.params_b_384k - self.params_b_192k) * (context - lo) / (hi - lo)


PAPER_MODELS = {
    "gpt-7b": PaperModel(4.480441895, 5.128e-6, 0.1839576, 629.3563, 4096, 32, 7.12, 7.85),
    "gpt-13b": PaperModel(4.220439453, 9.2852e-6, 0.3060189, 1132.5632, 5120, 40, 13.12, 14.03),
    "gpt-30b": PaperModel(3.417381836, 15.4262e-6, 0.8035742, 2789.3644, 6656, 60, 31.53, 32.72),
}


def paper_bandwidth(num_gpus: int = 64) -> dict[int, float]:
    """The paper's measured all-to-all bandwidth in bytes/s for degrees 2..64, extended to
    ``num_gpus`` with the 64-GPU value."""
    table = {d: v * MB * 1000 for d, v in PAPER_BANDWIDTH_MB_PER_MS.items()}
    degree = 128
    while degree <= num_gpus:
        table[degree] = table[64]
        degree *= 2
    return table


def paper_preset(name: str, context: int = 384 * 1024, num_gpus: int = 64, *, sharding: str = "full") -> CostModel:
    """The paper's cost model for ``name`` at a context limit, model states sharded ``sharding``
    (``flexsp.sharding``; the paper ran ZeRO-3, ``"full"``) over ``num_gpus`` GPUs."""
    key = name.lower()
    if key not in PAPER_MODELS:
        raise CostModelError(f"unknown preset {name!r}; choose one of {sorted(PAPER_MODELS)}")
    if context < 1 or num_gpus < 1:
        raise CostModelError(f"context and num_gpus must be >= 1, got {context} and {num_gpus}")
    check_sharding(sharding)
    model = PAPER_MODELS[key]
    states_mb = model_state_bytes(model.params_b(context) * 2**30, num_gpus, sharding) / MB  # the paper's B = 2**30
    free_mb = MEMORY_LIMIT_MB - states_mb
    if free_mb <= 0:
        raise CostModelError(f"{name} model states ({states_mb:.0f} MB per GPU, sharding {sharding!r}) exceed the 30 GB "
                             f"limit on {num_gpus} GPUs")
    exact_params = context in (192 * 1024, 384 * 1024)
    return CostModel(
        alpha1=model.alpha1_ms / 1000,
        alpha2=model.alpha2_ms / 1000,
        beta1=model.beta1_ms / 1000,
        comm_bytes_per_token=4 * 2 * model.layers * model.hidden * 2,
        alltoall_bandwidth=paper_bandwidth(num_gpus),
        token_capacity=math.floor(free_mb / model.act_mb_per_token),
        meta={"source": "FlexSP paper (arXiv 2412.01523), 64 x A100-40GB", "preset": key, "context": context,
              "num_gpus": num_gpus, "sharding": sharding, "params_b": round(model.params_b(context), 4),
              "activation_bytes_per_token": model.act_mb_per_token * MB,
              "params": "published" if exact_params else "interpolated between 192K and 384K",
              "bandwidth": "published" if num_gpus <= 64 else "published to 64 GPUs, 64-GPU value above"},
    )
