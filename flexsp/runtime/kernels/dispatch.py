"""``attend``: causal attention per packed sequence, never across, through the kernel the rule picks,
under the padding contract (exactly zero output and gradient for rows past ``cu_seqlens[-1]``)."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from flexsp.runtime.kernels import flash, sdpa, varlen
from flexsp.runtime.kernels.layout import Bounds, bounds_tensor, check_shapes, host_bounds, known_bounds, max_len
from flexsp.runtime.kernels.padding import Rows, contained
from flexsp.runtime.kernels.reference import reference
from flexsp.runtime.kernels.rule import resolve_backend


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Bounds, *,
           max_seqlen: int | None = None, backend: str = "auto", scale: float | None = None,
           bounds: Sequence[int] | None = None) -> torch.Tensor:
    """Causal attention per packed sequence; returns ``[tokens, heads, dim]`` like ``q``.

    ``bounds``: ``cu_seqlens`` as host ints, for the per-sequence kernels when ``cu_seqlens`` is on a
    device, and for the rule's length mix."""
    check_shapes(q, k, v, same_tokens=True)
    kernel = resolve_backend(backend, q, known_bounds(cu_seqlens, bounds))
    tokens, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if kernel == "reference":
        return reference(q, k, v, cu_seqlens if bounds is None else bounds, scale=scale)
    if kernel in ("sdpa", "sdpa_each"):
        host = host_bounds(cu_seqlens, bounds, tokens, "cu_seqlens")
        return contained(lambda q, k, v: sdpa.packed(q, k, v, host, scale, batch=kernel == "sdpa"), q, k, v,
                         Rows.of(host, tokens, q.device))
    cu = bounds_tensor(cu_seqlens, tokens, q.device, "cu_seqlens")
    max_seqlen = max_len(cu_seqlens, max_seqlen, "max_seqlen")
    if kernel == "flash":
        run = lambda q, k, v: flash.forward(q, k, v, cu, max_seqlen, scale)  # noqa: E731
    else:
        run = lambda q, k, v: varlen.forward(q, k, v, cu, max_seqlen, scale, cudnn=kernel == "varlen_cudnn")  # noqa: E731
    return contained(run, q, k, v, Rows.of(cu, tokens, q.device))
