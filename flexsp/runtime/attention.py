"""Local attention over packed sequences: causal within each sequence, never across.

One entry point, ``attend(q, k, v, cu_seqlens, backend=...)``, in front of three kernels:
``flash`` (flash-attn varlen; CUDA + fp16/bf16 only, optional), ``sdpa`` (torch SDPA, one call per
sequence) and ``reference`` (explicit softmax under a block-diagonal causal mask; slow, for tests).
Shapes: ``q [tokens, heads, dim]``, ``k``/``v`` ``[tokens, kv_heads, dim]`` with heads % kv_heads == 0.
``cu_seqlens`` (``[n+1]`` ints, a tuple or a tensor) bounds the real sequences; tokens past
``cu_seqlens[-1]`` are padding: they attend to nothing, nothing attends to them, and their output is zero.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

try:  # optional: only on GPU machines with flash-attn built
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match the installed torch
    flash_attn_varlen_func = None

BACKENDS = ("auto", "flash", "sdpa", "reference")


def flash_available(device: torch.device | None = None) -> bool:
    """flash-attn is importable and a CUDA device is there to run it."""
    if flash_attn_varlen_func is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``auto`` -> flash when it can run on ``q`` (CUDA, half precision), otherwise SDPA."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "flash" if flash_available(q.device) and q.dtype in (torch.float16, torch.bfloat16) else "sdpa"
    if backend == "flash" and not flash_available(q.device):
        raise ValueError("attention backend 'flash' needs flash_attn installed and CUDA tensors; "
                         "use backend='sdpa' or 'auto'")
    return backend


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Sequence[int] | torch.Tensor, *,
           max_seqlen: int | None = None, backend: str = "auto", scale: float | None = None) -> torch.Tensor:
    """Causal attention per packed sequence; returns ``[tokens, heads, dim]`` like ``q``."""
    tokens, heads, dim = q.shape
    if k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{tokens}, kv_heads, {dim}]")
    if heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} kv heads")
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not bounds or bounds[0] != 0 or any(nxt < cur for cur, nxt in zip(bounds, bounds[1:])) or bounds[-1] > tokens:
        raise ValueError(f"cu_seqlens must rise from 0 to at most {tokens} tokens, got {bounds}")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if max_seqlen is None:
        max_seqlen = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    real = bounds[-1]
    kernel = _KERNELS[resolve_backend(backend, q)]
    out = kernel(q[:real], k[:real], v[:real], bounds, max_seqlen, scale)
    if real < tokens:  # padding rows: zero output, no gradient
        out = torch.cat([out, out.new_zeros(tokens - real, heads, dim)])
    return out


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _flash(q, k, v, bounds, max_seqlen, scale):
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)


def _sdpa(q, k, v, bounds, max_seqlen, scale):
    heads = q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        # [s, h, d] -> [h, s, d]; SDPA's is_causal is exactly "causal within this sequence".
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else q[:0].clone()


def _reference(q, k, v, bounds, max_seqlen, scale):
    tokens, heads = q.shape[0], q.shape[1]
    k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    seq = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    pos = torch.arange(tokens)
    allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])   # block-diagonal causal
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"flash": _flash, "sdpa": _sdpa, "reference": _reference}
