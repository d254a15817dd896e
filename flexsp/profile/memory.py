"""Memory profile: activation bytes per token, model-state bytes by sharding, and the token capacity.

Activation memory per token is the slope of activation bytes against sequence length (a least-squares
line over the measured lengths): the slope drops what does not grow with tokens (gradients,
workspaces), which the token-capacity model accounts for separately or not at all.

* GPU: ``torch.cuda.max_memory_allocated`` during forward + backward, minus what was allocated before.
  Measured (not exercised in CI: no GPU there).
* CPU: an **estimate** - the bytes of every distinct tensor storage autograd saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded. It misses transient buffers
  and allocator overhead, so it is a lower bound on the GPU figure; the cost model's meta says so.

Layers extrapolate as in ``compute``: full = base + layers / run_layers * (k blocks - base).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import model_state_bytes, token_capacity
from flexsp.profile.compute import GroupRunner, forward_backward, make_shard


@dataclass(frozen=True)
class MemoryProfile:
    method: str                        # "cuda.max_memory_allocated" or "estimate: saved tensors"
    estimate: bool
    lengths: tuple[int, ...]
    activation_bytes: tuple[float, ...]   # full model, per measured length
    bytes_per_token: float
    constant_bytes: float

    def to_dict(self) -> dict:
        return {"method": self.method, "estimate": self.estimate, "lengths": list(self.lengths),
                "activation_bytes": list(self.activation_bytes), "bytes_per_token": self.bytes_per_token,
                "constant_bytes": self.constant_bytes}


def _saved_bytes(model: torch.nn.Module, shard, ctx) -> int:
    """Bytes of distinct storages autograd keeps for backward during one forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if hasattr(model, "shard_loss"):   # the HF adapter: its chunked loss, as in training
            loss = model.shard_loss(shard.input_ids, shard.position_ids, shard.labels, ctx)
        else:
            logits = model(shard.input_ids, shard.position_ids, ctx)
            loss = torch.nn.functional.cross_entropy(logits.float(), shard.labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return sum(seen.values())


def _peak_bytes(model: torch.nn.Module, shard, ctx, device: torch.device) -> int:
    """Peak bytes allocated on ``device`` above the starting point during forward + backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    forward_backward(model, shard, ctx)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def activation_profile(runner: GroupRunner, lengths: Sequence[int]) -> MemoryProfile:
    """Activation bytes of the full model at each length (degree 1) and the per-token slope."""
    if len(set(int(n) for n in lengths)) < 2:
        raise ValueError(f"the memory profile needs at least 2 distinct lengths, got {list(lengths)}")
    device = runner.setup.device
    on_gpu = device.type == "cuda"
    measured = []
    for n in lengths:
        shard, ctx = make_shard([int(n)], 1, 0, runner.spec.vocab, device, None, runner.setup.backend)
        total = 0.0
        for model, weight in runner.models():
            b = _peak_bytes(model, shard, ctx, device) if on_gpu else _saved_bytes(model, shard, ctx)
            total += weight * b
        measured.append(total)
    x = np.asarray([int(n) for n in lengths], dtype=np.float64)
    slope, intercept = np.polyfit(x, np.asarray(measured), 1)
    return MemoryProfile(method="cuda.max_memory_allocated" if on_gpu else "estimate: autograd saved tensors (CPU)",
                         estimate=not on_gpu, lengths=tuple(int(n) for n in lengths),
                         activation_bytes=tuple(float(m) for m in measured), bytes_per_token=float(slope),
                         constant_bytes=float(intercept))


@dataclass(frozen=True)
class CapacityResult:
    memory_bytes: float
    usable_fraction: float
    num_gpus: int
    params: float
    model_state_bytes: float
    token_capacity: int
    sharding: str = "full"            # flexsp.plan.memory choice the capacity assumes (recorded in the cost model)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def capacity(params: float, bytes_per_token: float, memory_bytes: float, *, sharding: str = "full",
             num_gpus: int = 1, usable_fraction: float = 0.9) -> CapacityResult:
    """Token capacity of one GPU: usable memory minus the model states of ``sharding`` (``flexsp.plan.memory``)."""
    states = model_state_bytes(params, num_gpus, check_sharding(sharding))
    cap = token_capacity(memory_bytes, states, bytes_per_token, usable_fraction=usable_fraction)
    return CapacityResult(memory_bytes, usable_fraction, num_gpus, float(params), float(states), cap, sharding)


def device_memory_bytes(device: torch.device) -> float:
    """Total memory of the device: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
