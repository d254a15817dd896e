"""``attend``: causal attention per packed sequence, never across, through the kernel the rule picks,
under the padding contract (exactly zero output and gradient for rows past ``cu_seqlens[-1]``)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import torch

from flexsp.runtime.kernels import flash, sdpa, varlen
from flexsp.runtime.kernels.capability import attend_kernel
from flexsp.runtime.kernels.features import PLAIN, Features, chunked_bounds
from flexsp.runtime.kernels.layout import (Bounds, bounds_tensor, check_shapes, host_bounds, known_bounds, max_len,
                                           narrow_values, widen_values)
from flexsp.runtime.kernels.lse import attend_lse
from flexsp.runtime.kernels.padding import Rows, contained
from flexsp.runtime.kernels.reference import reference
from flexsp.runtime.kernels.rule import resolve_backend
from flexsp.runtime.kernels.sinks import check_sinks, with_sinks


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Bounds, *,
           max_seqlen: int | None = None, backend: str = "auto", scale: float | None = None,
           bounds: Sequence[int] | None = None, features: Features | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention per packed sequence; returns ``[tokens, heads, dim]`` like ``q``.

    ``bounds``: ``cu_seqlens`` as host ints, for the per-sequence kernels when ``cu_seqlens`` is on a
    device, and for the rule's length mix. ``features``: the layer's window, chunk and softcap
    (``features.Features``; None: plain causal). ``sinks [heads]``: per-head sink logits (``sinks.py``). A ``v``
    narrower than q/k (latent attention) is padded for the kernel and the output cut back to its width."""
    width = v.shape[-1]
    if width != q.shape[-1]:
        return narrow_values(attend(q, k, widen_values(q, v), cu_seqlens, max_seqlen=max_seqlen, backend=backend,
                                    scale=scale, bounds=bounds, features=features, sinks=sinks), width)
    check_shapes(q, k, v, same_tokens=True)
    tokens, heads, dim = q.shape
    features = PLAIN if features is None else features
    if sinks is not None:
        check_sinks(sinks, heads)
    if features.chunk is not None:   # chunked attention is causal attention over the chunks: every kernel's
        cut_chunk = features.chunk
        cut = chunked_bounds(tuple(host_bounds(cu_seqlens, bounds, tokens, "cu_seqlens")), features.chunk)
        cu_seqlens, bounds, features = cut, cut, replace(features, chunk=None)
        max_seqlen = None if max_seqlen is None else min(int(max_seqlen), cut_chunk)
    kernel = resolve_backend(backend, q, known_bounds(cu_seqlens, bounds))
    kernel, via_lse = attend_kernel(kernel, features, sinks is not None)
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if kernel == "reference":
        return reference(q, k, v, cu_seqlens if bounds is None else bounds, scale=scale, window=features.window,
                         softcap=features.softcap, sinks=sinks)
    if via_lse:
        out, lse = attend_lse(q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                              causal=True, backend=kernel, scale=scale, bounds_q=bounds, bounds_k=bounds,
                              features=features)
        return out if sinks is None else with_sinks(out, lse, sinks)[0]
    if kernel in ("sdpa", "sdpa_each"):
        host = host_bounds(cu_seqlens, bounds, tokens, "cu_seqlens")
        return contained(lambda q, k, v: sdpa.packed(q, k, v, host, scale, batch=kernel == "sdpa"), q, k, v,
                         Rows.of(host, tokens, q.device))
    cu = bounds_tensor(cu_seqlens, tokens, q.device, "cu_seqlens")
    max_seqlen = max_len(cu_seqlens, max_seqlen, "max_seqlen")
    if kernel == "flash":
        run = lambda q, k, v: flash.forward(q, k, v, cu, max_seqlen, scale, window=features.window,  # noqa: E731
                                            softcap=features.softcap, sinks=sinks)
    else:
        run = lambda q, k, v: varlen.forward(q, k, v, cu, max_seqlen, scale, cudnn=kernel == "varlen_cudnn",  # noqa: E731
                                             features=None if features.plain else features)
    return contained(run, q, k, v, Rows.of(cu, tokens, q.device))

