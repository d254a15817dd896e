"""The one place that decides which SP axis serves a group: Ulysses alone, or Ulysses x ring.

Models call ``sp_attention(q, k, v, ctx)`` in every attention layer; the context built for the
micro-batch says which axis its group runs (``ctx.ring`` is set for a Ulysses x ring group). A new SP
axis is one module beside ``ulysses`` and ``ring`` plus one branch here.
"""
from __future__ import annotations

import torch

from flexsp.runtime.kernels.features import Features
from flexsp.runtime.sp.context import AttentionContext
from flexsp.runtime.sp.ring import ring_attention
from flexsp.runtime.sp.ulysses import ulysses_attention


def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                 features: Features | None = None, sinks: torch.Tensor | None = None,
                 scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's token shard over its SP group; returns ``q``'s shape.

    ``q [tokens/d, heads, dim]``, ``k``/``v`` ``[tokens/d, kv_heads, dim]`` (this rank's shard).
    ``features``: the layer's window, chunk and softcap (``flexsp.runtime.kernels.Features``, built once
    per layer; None: plain causal); ``sinks [heads]``: its per-head sink logits (every head; each rank uses
    its own); ``scale``: the scores' scale (None: ``1/sqrt(dim)``), applied by the kernel (folding it into a bf16
    ``q`` would round ``q`` again)."""
    if ctx.ring is not None:
        return ring_attention(q, k, v, ctx, features, sinks, scale)
    return ulysses_attention(q, k, v, ctx, features, sinks, scale)
