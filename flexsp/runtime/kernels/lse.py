"""Partial attention with its log-sum-exp, for the ring: ``attend_lse``, the no-autograd ``lse_forward``
/ ``lse_backward`` pair the ring's hand-written backward calls, and ``merge_partials``.

Every entry point applies the padding contract itself (``padding.Rows``): ``lse_forward`` returns
``(0, -inf)`` for rows outside the query bounds and rows without keys, ``lse_backward`` exactly zero
gradient for query rows past ``cu_q[-1]`` and key rows past ``cu_k[-1]`` - also with *merged* statistics,
which is how the ring calls it - whatever the kernel left there.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from flexsp.runtime.kernels import sdpa, varlen
from flexsp.runtime.kernels.capability import lse_kernel as feature_lse_kernel
from flexsp.runtime.kernels.features import PLAIN, Features
from flexsp.runtime.kernels.layout import (AttentionError, Bounds, LseSpec, bounds_tensor, check_shapes, host_bounds,
                                           known_bounds, max_len)
from flexsp.runtime.kernels.padding import Rows
from flexsp.runtime.kernels.reference import reference
from flexsp.runtime.kernels.rule import lse_kernel

_VARLEN_KERNELS = ("varlen", "varlen_cudnn")


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Bounds, cu_seqlens_k: Bounds, *,
               max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool,
               backend: str = "auto", scale: float | None = None, bounds_q: Sequence[int] | None = None,
               bounds_k: Sequence[int] | None = None, features: Features | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [tokens_q, heads, dim], lse [heads, tokens_q])``; see the package docstring for the rules.
    ``features``: the layer's window, chunk and softcap, on bottom-right aligned positions."""
    check_shapes(q, k, v, same_tokens=False)
    features = PLAIN if features is None else features
    kind = feature_lse_kernel(lse_kernel(backend, q, known_bounds(cu_seqlens_q, bounds_q)), features, False)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if kind == "reference":
        return reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, return_lse=True,
                         window=features.window, chunk=features.chunk, softcap=features.softcap)
    cu_q = bounds_tensor(cu_seqlens_q, q.shape[0], q.device, "cu_seqlens_q")
    cu_k = bounds_tensor(cu_seqlens_k, k.shape[0], q.device, "cu_seqlens_k")
    if cu_q.numel() != cu_k.numel():
        raise AttentionError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    max_q = max_len(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    max_k = max_len(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
    feats = None if features.plain else features
    if kind in _VARLEN_KERNELS:
        spec = LseSpec(cu_q, cu_k, max_q, max_k, bool(causal), scale, kind, features=feats)
    else:
        host_q = tuple(host_bounds(cu_seqlens_q, bounds_q, q.shape[0], "cu_seqlens_q"))
        host_k = tuple(host_bounds(cu_seqlens_k, bounds_k, k.shape[0], "cu_seqlens_k"))
        spec = LseSpec(cu_q, cu_k, max_q, max_k, bool(causal), scale, "sdpa", host_q, host_k, features=feats)
    return _AttendLse.apply(q, k, v, spec)


def _rows(spec: LseSpec, q: torch.Tensor, k: torch.Tensor) -> Rows:
    # host bounds where the spec has them (no device read), else the device bounds
    cu_q = spec.bounds_q if spec.bounds_q is not None else spec.cu_q
    cu_k = spec.bounds_k if spec.bounds_k is not None else spec.cu_k
    return Rows.of(cu_q, q.shape[0], q.device, cu_k, k.shape[0])


def lse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """No-autograd partial attention: ``(out, lse)`` with the conventions of ``attend_lse``."""
    raw = varlen.lse_forward if spec.kernel in _VARLEN_KERNELS else sdpa.each_forward
    out, lse = raw(q, k, v, spec)
    return _rows(spec, q, k).partial(out, lse)


def lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, spec: LseSpec, dlse: torch.Tensor | None = None):
    """Gradients ``(dq, dk, dv)`` of one partial call, given the softmax statistics ``out``/``lse``.

    With the partial's own ``out``/``lse`` this is its exact backward. With the *merged* ``out``/``lse``
    of several partials over disjoint keys (and ``dlse`` None) it is this partial's share of the
    merged attention's gradient - how the ring's backward works (FlashAttention's recurrence:
    ``dS = P * (dP - D)``, ``D = rowsum(dO * O)``, ``P = exp(S - lse)``). ``dlse`` adds ``dS += dlse * P``.
    Rows outside the bounds get exactly zero gradient.
    """
    rows = _rows(spec, q, k)
    # the statistics' own padding rows are cleaned first: a NaN there must not reach the kernel's real rows
    out, lse = rows.partial(out, lse)
    dout = rows.output(dout)
    raw = varlen.lse_backward if spec.kernel in _VARLEN_KERNELS else sdpa.each_backward
    return rows.grads(*raw(dout, q, k, v, out, lse, spec, dlse))


class _AttendLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec):
        out, lse = lse_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = lse_backward(dout, q, k, v, out, lse, ctx.spec, dlse)
        return dq, dk, dv, None


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results.

    ``lse = log(e^lse_a + e^lse_b)`` and ``out = w_a*out_a + w_b*out_b`` with ``w = e^(lse_x - lse)``,
    computed against the row maximum so nothing overflows; rows empty in both stay ``(0, -inf)``. A
    partial whose weight is zero contributes exactly zero, whatever its ``out`` holds (a selection,
    not ``0 * out``: NaN stays out, forward and backward).
    """
    top = torch.maximum(lse_a, lse_b)
    shift = sdpa.finite(top)
    wa, wb = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = wa + wb
    seen = total > 0
    safe = torch.where(seen, total, torch.ones((), dtype=total.dtype, device=total.device))
    lse = torch.where(seen, shift + torch.log(safe), -math.inf)
    ct = torch.promote_types(lse.dtype, out_a.dtype)

    def share(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = (w / safe).t().unsqueeze(-1)
        return out.to(ct).masked_fill(w == 0, 0.0) * w.to(ct)     # masked_fill: where() keeping out's layout
    return (share(out_a, wa) + share(out_b, wb)).to(out_a.dtype), lse   # out first: its layout is kept
