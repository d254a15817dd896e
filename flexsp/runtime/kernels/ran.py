"""Which attention kernel actually ran, read from the profiler's op names: the record the selftest and the GPU
step benchmark write, forward and backward apart.

The rule (``rule.py``) says what FlexSP asks for; the installed torch decides what runs inside
``varlen_attn`` (a torch that selects by ``sdpa_kernel`` may fall back to Flash, another may pick cuDNN by
itself), so the report names the aten kernels the profiler saw, not the request. One profiled call costs
milliseconds on the host; it is for reports, never for the training step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

# aten op name fragment -> kernel, most specific first (SDPA's wrappers name the kernel they dispatch to)
KERNELS = (
    ("_scaled_dot_product_cudnn_attention", "sdpa cudnn"),
    ("_scaled_dot_product_flash_attention_for_cpu", "sdpa flash (cpu)"),
    ("_scaled_dot_product_flash_attention", "sdpa flash"),
    ("_scaled_dot_product_efficient_attention", "sdpa efficient"),
    ("_scaled_dot_product_attention_math", "sdpa math"),
    ("_cudnn_attention_", "cudnn"),
    ("_flash_attention_", "flash"),
    ("_efficient_attention_", "efficient"),
    ("flash_attn", "flash-attn"),
)


def kernel_of(op_name: str) -> str | None:
    """The attention kernel an op name belongs to, or None for any other op."""
    for fragment, kernel in KERNELS:
        if fragment in op_name:
            return kernel
    return None


def kernels_in(fn: Callable[[], Any]) -> tuple[Any, dict[str, list[str]]]:
    """``(fn(), {"forward": [...], "backward": [...]})``: the attention kernels ``fn``'s ops ran, sorted, read
    from the profiler's CPU-side op names (every CUDA kernel launch is made from one); an op whose name says
    ``backward`` is a backward kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    seen: dict[str, set[str]] = {"forward": set(), "backward": set()}
    for event in prof.events():
        kernel = kernel_of(event.name)
        if kernel is not None:
            seen["backward" if "backward" in event.name else "forward"].add(kernel)
    return result, {phase: sorted(kernels) for phase, kernels in seen.items()}


def describe(kernels: dict[str, list[str]]) -> str:
    """``forward flash, backward flash`` (``none`` where no attention kernel ran)."""
    return ", ".join(f"{phase} {'+'.join(kernels.get(phase, [])) or 'none'}" for phase in ("forward", "backward"))


def merged(*records: dict[str, list[str]]) -> dict[str, list[str]]:
    """Several records as one (each phase's kernels, sorted)."""
    return {phase: sorted({k for r in records for k in r.get(phase, [])}) for phase in ("forward", "backward")}
