"""Ulysses for token mixers that are recurrences over the sequence (Gated DeltaNet and its short convolution).

A recurrence cannot be split along the sequence without carrying its state between ranks, but its heads
(and a depthwise convolution's channels) are independent. So, like Ulysses attention: one all-to-all
trades this rank's token shard ``[tokens/d, heads, ...]`` for every token of ``heads/d`` heads, the
operator runs locally over each whole packed sequence (``segments.by_sequence``: state restarted at every
sequence's first token, padding rows zero), and a second all-to-all restores the token shard.
Communication is ``ulysses_comm``'s; the local operator is the caller's (the model's own function).

Heads: ``d`` must divide the value (output) heads; key heads need not - each is replicated just enough
for every rank to hold the ones its value heads use, as Ulysses attention does for kv heads. A
convolution needs ``d`` to divide its channels. A ring group cannot run a recurrence exactly (its state
would have to pass around the ring): refused.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flexsp.runtime.kernels.padding import guard_rows, keep_rows, real_rows
from flexsp.runtime.sp.context import AttentionContext, ShardingError
from flexsp.runtime.sp.segments import by_sequence


def _bounds(ctx: AttentionContext) -> tuple[int, ...]:
    if ctx.bounds is not None:
        return tuple(ctx.bounds)
    return tuple(int(b) for b in ctx.cu_seqlens.tolist())   # one host read per call (contexts built without bounds)


def _check_axis(ctx: AttentionContext, what: str) -> None:
    if ctx.ring is not None:
        raise ShardingError(f"{what}: a recurrence cannot be split over a ring group exactly (its state would have to "
                            f"pass from rank to rank); plan Ulysses-only groups (PlanConfig(ulysses_only=True))")


def group_rank(ctx: AttentionContext) -> int:
    return dist.get_rank(ctx.group) if ctx.group is not None and dist.is_initialized() else 0


def check_linear_heads(value_heads: int, degree: int, what: str = "linear attention") -> None:
    if value_heads % degree:
        usable = [d for d in range(1, value_heads + 1) if value_heads % d == 0]
        raise ShardingError(f"{what}: SP degree {degree} does not divide its {value_heads} value heads; its degrees "
                            f"are the divisors {usable}")


def ulysses_conv(x: torch.Tensor, params: Sequence[torch.Tensor | None], ctx: AttentionContext,
                 local: Callable[..., torch.Tensor]) -> torch.Tensor:
    """A depthwise causal convolution of this rank's token shard ``x [tokens/d, channels]`` over its group.

    ``params`` (``[channels, ...]`` each, or None: the weight, the bias) are sliced to this rank's channel
    block; ``local(x_batch, *blocks)`` maps ``[n, length, channels/d]`` to the same shape, once per distinct
    sequence length."""
    _check_axis(ctx, "causal convolution")
    d = ctx.degree
    channels = x.shape[1]
    if channels % d:
        raise ShardingError(f"causal convolution: SP degree {d} does not divide its {channels} channels")
    rank = group_rank(ctx)
    blocks = [p if p is None or d == 1 else p.chunk(d, dim=0)[rank] for p in params]
    full = ctx.trades.seq_to_head(x[:, :, None])[:, :, 0] if d > 1 else x      # [tokens, channels/d]
    (out,) = by_sequence(lambda xs: (local(xs, *blocks),), [full], _bounds(ctx), full.shape[0])
    return ctx.trades.head_to_seq(out[:, :, None])[:, :, 0] if d > 1 else out


def ulysses_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       ctx: AttentionContext, local: Callable[..., torch.Tensor],
                       varlen: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """A gated delta-rule recurrence of this rank's token shard over its group; returns ``v``'s shape.

    ``q``/``k`` ``[tokens/d, key_heads, dk]``, ``v`` ``[tokens/d, value_heads, dv]``, ``g``/``beta``
    ``[tokens/d, value_heads]``. ``local(q, k, v, g, beta)`` takes one batch ``[n, length, ...]`` of equal-length
    sequences (the model's own torch function); ``varlen(q, k, v, g, beta, cu_seqlens)``, when given,
    takes the whole stream at once (flash-linear-attention's kernel; int64 bounds, the same tensor for every
    layer of a micro-batch) and may leave padding rows unwritten, in its output and in its gradients."""
    _check_axis(ctx, "linear attention")
    d = ctx.degree
    key_heads, value_heads = k.shape[1], v.shape[1]
    check_linear_heads(value_heads, d)
    if value_heads % key_heads:
        raise ShardingError(f"linear attention: {value_heads} value heads are not a multiple of {key_heads} key heads")
    if d > 1:
        r = d // math.gcd(key_heads, d)   # key heads replicated just enough (r divides value_heads/key_heads)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        trades = ctx.trades
        q, k, v = (trades.seq_to_head(t) for t in (q, k, v))
        g, beta = (trades.seq_to_head(t[:, :, None])[:, :, 0] for t in (g, beta))
    bounds = _bounds(ctx)
    rows = v.shape[0]
    if varlen is not None:
        # the kernel may leave padding rows unwritten in its output and in every gradient it returns: both zeroed
        real = real_rows(bounds, rows, v.device)
        out = keep_rows(real, varlen(*guard_rows(real, q, k, v, g, beta), ctx.cu_seqlens_int64))
    else:
        (out,) = by_sequence(lambda *xs: (local(*xs),), [q, k, v, g, beta], bounds, rows)
    return ctx.trades.head_to_seq(out) if d > 1 else out
