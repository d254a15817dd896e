"""flash-attn's varlen kernel (optional: GPU machines with flash-attn built), generation 3 or 2.

FlashAttention-3 (Hopper) installs as ``flash_attn_interface``, FlashAttention-2 as ``flash_attn``; both
take ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., softmax_scale=, causal=)``
and read kv head ``h // (heads / kv_heads)`` themselves. FA3 releases differ in whether they also return
the lse: the first element of a tuple is the output. Raw: rows outside ``cu_seqlens`` are unspecified
(``padding.py`` makes them zero). The lse forms the ring needs use ``varlen_attn`` (whose backward takes
merged statistics through a stable op) or the per-sequence kernels, never flash-attn's private backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class FlashAPI:
    """The installed flash-attn varlen function and its generation (2 or 3)."""

    fn: Callable[..., Any]
    generation: int


def installed() -> FlashAPI | None:
    """FA3 if importable, else FA2, else None (absent, or a build that does not match the installed torch)."""
    try:
        from flash_attn_interface import flash_attn_varlen_func as fa3
        return FlashAPI(fa3, 3)
    except Exception:
        pass
    try:
        from flash_attn import flash_attn_varlen_func as fa2
        return FlashAPI(fa2, 2)
    except Exception:
        return None


FLASH: FlashAPI | None = installed()   # read once at import


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
            scale: float) -> torch.Tensor:
    """Causal flash-attn over the packed stream; differentiable through flash-attn's own backward."""
    out = FLASH.fn(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out
