"""Host-to-device copies that never make the host wait: the one way the runtime moves host data to a device.

A copy from pageable host memory to CUDA is synchronous (the driver stages it through a bounce
buffer, and ``non_blocking`` cannot help), so every host-built tensor the step needs (``cu_seqlens``,
packed token ids, position ids, zigzag rows) goes through ``to_device``: pinned, then copied with
``non_blocking=True`` on the current stream, which orders it before the kernels that read it. The
pinned block comes from torch's caching host allocator, which keeps it until the copy has finished.
Pinning needs a CUDA-enabled build with a device; elsewhere (CPU, or another device type) the copy is
a plain ``.to``.
"""
from __future__ import annotations

from typing import Any

import torch


def pinning_available(device: torch.device) -> bool:
    """Whether a copy to ``device`` can start from pinned memory (a CUDA target on a CUDA-enabled torch)."""
    return device.type == "cuda" and torch.cuda.is_available()


def to_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``tensor`` on ``device`` (``None``: where it is) without a pageable host-to-device copy."""
    if device is None:
        return tensor
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type != "cpu":
        if pinning_available(device):
            return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)   # no-op, device to device (asynchronous anyway), or a device without pinning


def host_tensor(data: Any, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``: built on the host, pinned and copied without blocking
    where pinning is available (never ``torch.tensor(..., device=cuda)`` there, which copies from pageable
    memory and blocks the host); elsewhere built on ``device`` directly."""
    if device is not None and pinning_available(torch.device(device)):
        return to_device(torch.tensor(data, dtype=dtype), device)
    return torch.tensor(data, dtype=dtype, device=device)
