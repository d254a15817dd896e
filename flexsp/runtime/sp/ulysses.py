"""Ulysses sequence parallelism: trade a token shard for a head shard, attend locally, trade back.

Each of the group's ``d`` ranks holds ``[tokens/d, heads, dim]``. One all-to-all gives it every
token of ``heads/d`` heads, so plain local attention over the packed sequences is exact; a second
all-to-all restores the token shard. Communication lives in ``ulysses_comm``, kernels in
``flexsp.runtime.kernels``; which axis serves a group is decided in ``attention``. The exchange moves
the padding rows ``pack`` adds too; the kernels' padding contract makes their output and gradient exactly
zero, so neither all-to-all carries what a kernel left in them.
"""
from __future__ import annotations

import math

import torch

from flexsp.runtime.kernels import attend
from flexsp.runtime.kernels.features import Features
from flexsp.runtime.kernels.sinks import check_sinks
from flexsp.runtime.sp.context import AttentionContext, check_heads
from flexsp.runtime.sp.ulysses_comm import head_part


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                      features: Features | None = None, sinks: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's token shard over its Ulysses group; returns ``q``'s shape.

    ``q [tokens/d, heads, dim]``, ``k``/``v`` ``[tokens/d, kv_heads, dim]``. With fewer kv heads than
    ranks (GQA/MQA) each kv head is replicated just enough for every rank to hold the ones its query
    heads use; the gradient of the copies sums back into the original head. No host sync: the
    layout was checked when the context was built (``pack`` sizes the shards to cover ``cu_seqlens``).
    ``features``: the layer's window/chunk/softcap; ``sinks [heads]`` (all heads): each rank uses the part
    of its heads, and the gradient of every part reaches its rows of ``sinks``. ``scale``: the scores' scale
    (None: ``1/sqrt(dim)``).
    """
    if ctx.group is None and ctx.exchange is None:   # degree 1: no exchange object, no head checks per layer
        return attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend, bounds=ctx.bounds,
                      features=features, sinks=sinks, scale=scale)
    d = ctx.degree
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, d)
    if d == 1:
        return attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend, bounds=ctx.bounds,
                      features=features, sinks=sinks, scale=scale)
    # Replicate kv heads r times so d divides them; r divides heads/kv_heads because d divides heads.
    r = d // math.gcd(kv_heads, d)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    trades = ctx.trades
    if sinks is not None:
        check_sinks(sinks, heads)
        sinks = head_part(sinks, ctx.group, getattr(trades, "rank", None))
    q, k, v = (trades.seq_to_head(t) for t in (q, k, v))     # a latent v at its own width on the wire
    out = attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend, bounds=ctx.bounds,
                 features=features, sinks=sinks, scale=scale)
    return trades.head_to_seq(out)
