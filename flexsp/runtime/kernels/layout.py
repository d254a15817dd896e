"""The packed layout every kernel reads: shape checks and ``cu_seqlens`` bounds (host metadata only).

Nothing here reads a device tensor on the host: a device ``cu_seqlens`` is trusted, a CPU one or a tuple
is checked (free), and the per-sequence kernels get host ints from ``bounds=`` rather than a sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from flexsp.errors import FlexSPError
from flexsp.runtime.transfer import host_tensor

Bounds = Sequence[int] | torch.Tensor


class AttentionError(FlexSPError):
    """Attention inputs do not fit together (shapes, bounds, backend)."""


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_tokens: bool) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise AttentionError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, dim]")
    if k.shape != v.shape or k.shape[2] != q.shape[2] or (same_tokens and k.shape[0] != q.shape[0]):
        want = f"[{q.shape[0]}, kv_heads, {q.shape[2]}]" if same_tokens else f"[tokens_k, kv_heads, {q.shape[2]}]"
        raise AttentionError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be {want}")
    if q.shape[1] % k.shape[1]:
        raise AttentionError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def narrow_values(out: torch.Tensor, width: int) -> torch.Tensor:
    """``out`` (the kernel's, at q's head size) cut back to the v heads' ``width`` (``widen_values``); untouched when
    they are as wide. Function-form ops, no ``[]``: fake CUDA tensors (the CI's CUDA check) refuse indexing."""
    return out if out.shape[-1] == width else out.narrow(-1, 0, width).contiguous()


def widen_values(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v`` zero-padded to ``q``'s head size where its own is smaller (multi-head latent attention: DeepSeek-V3's
    v heads are 128 wide, its q/k heads 192): every kernel takes one head size, and the output's extra columns are
    exactly zero (a weighted sum of zeros), so slicing them off is exact in value and gradient. A wider ``v`` is
    refused."""
    extra = q.shape[-1] - v.shape[-1]
    if extra < 0:
        raise AttentionError(f"v heads of {v.shape[-1]} are wider than the q/k heads of {q.shape[-1]}")
    return torch.nn.functional.pad(v, (0, extra)) if extra else v


def check_bounds(bounds: list[int], tokens: int, name: str) -> None:
    if not bounds or bounds[0] != 0 or any(nxt < cur for cur, nxt in zip(bounds, bounds[1:])) or bounds[-1] > tokens:
        raise AttentionError(f"{name} must rise from 0 to at most {tokens} tokens, got {bounds}")


def bounds_tensor(cu: Bounds, tokens: int, device: torch.device, name: str) -> torch.Tensor:
    """``cu`` as an int32 tensor on ``device``; values are checked only where that costs no device sync."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
            raise AttentionError(f"{name} must be a 1-D int32 tensor of sequence bounds, got {cu.dtype} "
                                 f"{tuple(cu.shape)}")
        if cu.device.type == "cpu":          # reading a CPU tensor is free; a device tensor is trusted
            check_bounds([int(b) for b in cu.tolist()], tokens, name)
        return cu.to(device=device, dtype=torch.int32)
    bounds = [int(b) for b in cu]
    check_bounds(bounds, tokens, name)
    return host_tensor(bounds, torch.int32, device)   # a chunked layer's cut bounds, per layer: never a blocking copy


def max_len(cu: Bounds, given: int | None, name: str) -> int:
    if given is not None:
        return int(given)
    if isinstance(cu, torch.Tensor) and cu.device.type != "cpu":
        raise AttentionError(f"{name} is required with device cu_seqlens (reading it would sync the host)")
    bounds = [int(b) for b in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)


def host_bounds(cu: Bounds, given: Sequence[int] | None, tokens: int, name: str) -> list[int]:
    """The bounds as host ints for the per-sequence kernels: ``given``, a tuple, or a CPU tensor (free to
    read). A device tensor without ``given`` is refused: reading it would make every layer wait on the GPU."""
    if given is not None:
        bounds = [int(b) for b in given]
    elif isinstance(cu, torch.Tensor):
        if cu.device.type != "cpu":
            raise AttentionError(f"the per-sequence kernel needs {name} as host ints (bounds=, which "
                                 f"AttentionContext carries); reading device {name} would sync the host every layer")
        bounds = [int(b) for b in cu.tolist()]
    else:
        bounds = [int(b) for b in cu]
    check_bounds(bounds, tokens, name)
    return bounds


def known_bounds(cu: Bounds, given: Sequence[int] | None) -> tuple[int, ...] | None:
    """Host bounds when they are free to read (``given``, a tuple, a CPU tensor), else None: what the
    kernel rule reads for the length mix, never at the price of a sync."""
    if given is not None:
        return given if isinstance(given, tuple) else tuple(int(b) for b in given)   # the context's: as it is
    if isinstance(cu, torch.Tensor):
        return tuple(int(b) for b in cu.tolist()) if cu.device.type == "cpu" else None
    return tuple(int(b) for b in cu)


@dataclass(frozen=True, eq=False)
class LseSpec:
    """Everything but the tensors that one partial-attention call needs (bounds, maxima, mask, kernel)."""

    cu_q: torch.Tensor          # int32 bounds of the query sequences
    cu_k: torch.Tensor          # int32 bounds of the key sequences (same count)
    max_q: int
    max_k: int
    causal: bool
    scale: float
    kernel: str                 # "varlen" (device bounds only) or "sdpa" (per sequence, host bounds)
    bounds_q: tuple[int, ...] | None = None   # host copies for "sdpa"; None: read cu_q (a CPU tensor)
    bounds_k: tuple[int, ...] | None = None
    features: Any = None                      # ``features.Features`` of the layer (it imports this module); None: plain causal
    pos_q: torch.Tensor | None = None   # each query row's position in its sequence; None: from the bounds
    pos_k: torch.Tensor | None = None   # (bottom-right aligned); the ring's zigzag blocks give them
    host_pos_q: Any = None              # the same positions as host int arrays (numpy): the per-sequence
    host_pos_k: Any = None              # kernel bands its keys with them, never reading the device copies

    def host(self) -> tuple[list[int], list[int]]:
        """Host bounds of q and k for the per-sequence kernel (refuses to read a device tensor)."""
        return (host_bounds(self.cu_q, self.bounds_q, 1 << 62, "cu_seqlens_q"),
                host_bounds(self.cu_k, self.bounds_k, 1 << 62, "cu_seqlens_k"))
