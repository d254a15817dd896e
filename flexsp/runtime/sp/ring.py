"""Ulysses x ring attention: heads split by the all-to-all, K/V passed around a ring, causal work balanced.

A group of ``d = u * r`` ranks runs a sequence ``u``-way over heads and ``r``-way over tokens. Each rank
holds a slice of its ring shard (``zigzag``); the Ulysses all-to-all over its ``u`` consecutive ranks
turns that into the whole ring shard for ``heads/u`` heads; then ``r`` ring steps each attend the local
queries to one ring rank's K/V block (``attend``'s kernels, in their log-sum-exp form) and merge the
partials, while the next block is already travelling; a second all-to-all restores the token slice.

Backward (FlashAttention's recurrence, as ring-flash-attention does): every block's gradient is
computed from the *merged* output and lse, so no partial is kept. K/V travel round the ring again,
starting one hop ahead, and each block's dK/dV partial sum follows its K/V from rank to rank and ends at
its owner, who adds its own diagonal block's share.

Cost, what the runtime does (per layer and rank, one sequence of ``s`` tokens, head dim ``D``,
``b`` bytes per K/V element). A K/V message is the ring shard's K and V for this rank's kv heads:
``2 * (s/r) * kv_heads/gcd(u, kv_heads) * D * b`` bytes (GQA kv heads are replicated, never split,
below one per rank). The forward sends it ``r-1`` times; the backward sends K/V ``r-1`` times and the
dK/dV partial sums ``r-1`` times (in K/V's dtype, added in fp32 at each hop): ``3(r-1)`` messages. With
``ring_bytes_per_token = 3 * layers * 2 * kv_heads * D * b`` (``flexsp.plan.analytic``), summed over layers:

    ring_seconds(s) = ring_bytes_per_token * s * (r-1) / (r * gcd(u, kv_heads)) / ring_bandwidth

and each hop overlaps one block's compute - the zigzag layout makes every block the same half of a
shard-squared causal workload - so the step costs ``max(attention, ring_seconds)``: the cost model's
``max(alpha1*s^2/d, ring * s)`` term (``flexsp.plan.cost``). Not overlapped: the final dK/dV hop of the
backward (one message of ``3(r-1)``) and the per-hop latency, which ``beta1``/``alpha2`` absorb.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from flexsp.runtime.kernels import AttentionError, LseSpec, lse_backward, lse_forward, merge_partials
from flexsp.runtime.kernels.capability import lse_kernel as feature_lse_kernel
from flexsp.runtime.kernels.features import Features
from flexsp.runtime.kernels.layout import narrow_values, widen_values
from flexsp.runtime.kernels.rule import lse_kernel
from flexsp.runtime.kernels.sinks import check_sinks, sink_grad, sink_stats
from flexsp.runtime.sp.context import AttentionContext, RingContext, check_heads
from flexsp.runtime.sp.ring_comm import RingComm, place
from flexsp.runtime.sp.ulysses_comm import head_part, head_to_seq, seq_to_head
from flexsp.runtime.sp.zigzag import RingTensors, zigzag_layout


def _block(rt: RingTensors, j: int, kernel: str, scale: float, features: Features | None = None):
    """(query rows or None for all, K/V rows or None for all, spec) of this rank against ring rank
    ``j``'s K/V, or None when the block holds no token - or, for a layer with a window or chunk, when
    every query of the block is too far from every key of it (a sliding-window layer costs window-sized
    work, not the whole sequence's). ``features`` None: plain causal."""
    i = rt.index
    host = lambda bounds, k: bounds[k] if bounds else None  # noqa: E731   (host bounds: none in old contexts)
    positional = features is not None and features.positional
    if positional and j != i and rt.reach and features.unreachable(*rt.reach[j]):
        return None
    def pos(q, k, host_q, host_k) -> dict:
        if not positional:
            return dict(features=features)
        return dict(features=features, pos_q=q, pos_k=k, host_pos_q=host_q, host_pos_k=host_k)

    if j == i:
        if not rt.local_tokens[i]:
            return None
        return None, None, LseSpec(rt.cu_local[i], rt.cu_local[i], rt.max_local[i], rt.max_local[i], True, scale, kernel,
                                   host(rt.host_local, i), host(rt.host_local, i),
                                   **pos(_at(rt.pos_local, i), _at(rt.pos_local, i), _at(rt.host_pos_local, i),
                                         _at(rt.host_pos_local, i)))
    if j < i:   # j's early chunks precede both of ours: all our queries, j's first chunks, no mask
        if not (rt.local_tokens[i] and rt.first_tokens[j]):
            return None
        return None, rt.first_rows[j], LseSpec(rt.cu_local[i], rt.cu_first[j], rt.max_local[i], rt.max_first[j],
                                                False, scale, kernel, host(rt.host_local, i), host(rt.host_first, j),
                                                **pos(_at(rt.pos_local, i), _at(rt.pos_first, j),
                                                      _at(rt.host_pos_local, i), _at(rt.host_pos_first, j)))
    # j > i: both of j's chunks precede our late chunk and follow our early one
    if not (rt.second_tokens and rt.local_tokens[j]):
        return None
    return rt.second_rows, None, LseSpec(rt.cu_second, rt.cu_local[j], rt.max_second, rt.max_local[j], False, scale,
                                         kernel, rt.host_second or None, host(rt.host_local, j),
                                         **pos(rt.pos_second, _at(rt.pos_local, j), rt.host_pos_second,
                                               _at(rt.host_pos_local, j)))


def _at(parts: tuple, j: int):
    return parts[j] if parts else None


def _rows(x: torch.Tensor, rows: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    # function-form ops, not ``[]``, here and below: fake CUDA tensors (the CI's CUDA check) refuse indexing
    return x if rows is None else x.index_select(dim, rows)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rt: RingTensors, comm: RingComm, kernel: str, scale: float,
                features: Features | None = None, sinks: torch.Tensor | None = None):
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        for step in range(rt.ring):
            pending = comm.hop(kv) if step < rt.ring - 1 else None     # next block in flight ...
            block = _block(rt, (rt.index - step) % rt.ring, kernel, scale, features)
            if block is not None:                                      # ... while this one is computed
                q_rows, kv_rows, spec = block
                o, l = lse_forward(_rows(q, q_rows), _rows(kv.select(0, 0), kv_rows), _rows(kv.select(0, 1), kv_rows), spec)
                if q_rows is None:
                    out, lse = merge_partials(out, lse, o, l)
                else:
                    o, l = merge_partials(out.index_select(0, q_rows), lse.index_select(1, q_rows), o, l)
                    out.index_copy_(0, q_rows, o)
                    lse.index_copy_(1, q_rows, l)
            if pending is not None:
                kv = pending.wait()
        if sinks is not None:   # once, on the merged statistics of every block: exact (``sinks.py``)
            out, lse = sink_stats(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.rt, ctx.comm, ctx.kernel, ctx.scale, ctx.features = rt, comm, kernel, scale, features
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        rt, comm, kernel, scale, features = ctx.rt, ctx.comm, ctx.kernel, ctx.scale, ctx.features
        acc = torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])

        def block_grads(kv_block: torch.Tensor, j: int) -> torch.Tensor:
            """Add this block's dq; return its [2, tokens, kv_heads, dim] dK/dV share for ring rank j."""
            share = torch.zeros(kv_block.shape, dtype=acc, device=q.device)
            block = _block(rt, j, kernel, scale, features)
            if block is None:
                return share
            q_rows, kv_rows, spec = block
            dq_b, dk_b, dv_b = lse_backward(_rows(dout, q_rows), _rows(q, q_rows), _rows(kv_block.select(0, 0), kv_rows),
                                            _rows(kv_block.select(0, 1), kv_rows), _rows(out, q_rows), _rows(lse, q_rows, 1), spec)
            if q_rows is None:
                dq.add_(dq_b)
            else:
                dq.index_add_(0, q_rows, dq_b.to(acc))
            dkv_b = torch.stack([dk_b, dv_b]).to(acc)
            if kv_rows is None:
                share.add_(dkv_b)
            else:
                share.index_add_(1, kv_rows, dkv_b)
            return share

        pending_kv = comm.hop(kv) if rt.ring > 1 else None            # the first foreign block travels ...
        own = block_grads(kv, rt.index)                                # ... while the diagonal is computed
        pending_share = None
        for step in range(1, rt.ring):
            kv = pending_kv.wait()
            pending_kv = comm.hop(kv) if step < rt.ring - 1 else None
            share = block_grads(kv, (rt.index - step) % rt.ring)
            if pending_share is not None:                              # the same block's sum so far, from behind
                share += pending_share.wait().to(acc)
            pending_share = comm.hop(share.to(kv.dtype), tag=1)        # on to the next holder (last hop: owner)
        if pending_share is not None:
            own += pending_share.wait().to(acc)
        # with sinks, out/lse are the augmented statistics: the blocks' recurrence above is then exact for
        # q/k/v, and the sink's own gradient is one reduction over the merged rows
        dsinks = sink_grad(dout, out, lse, sinks[0]) if sinks else None
        return (dq.to(q.dtype), own.select(0, 0).to(k.dtype), own.select(0, 1).to(v.dtype), None, None, None, None,
                None, dsinks)   # trailing Nones past the inputs given are allowed


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
                   features: Features | None = None, sinks: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's token slice over its ``ulysses x ring`` group; returns q's shape.

    ``ctx`` is an ``AttentionContext`` whose ``group`` is the Ulysses sub-group and ``ring`` a
    ``RingContext``. ``q [tokens, heads, dim]``, ``k``/``v`` ``[tokens, kv_heads, dim]`` (this slice).
    ``features``/``sinks``: the layer's (``flexsp.runtime.kernels``); sinks ``[heads]``, all heads: this
    rank keeps its Ulysses part's. ``scale``: the scores' scale (None: ``1/sqrt(dim)``).
    """
    ring: RingContext = ctx.ring
    u = ctx.degree
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, u)
    if q.shape[0] * u != ring.tensors.shard_tokens:
        raise AttentionError(f"{u} Ulysses slices of {q.shape[0]} tokens do not make the ring shard of "
                         f"{ring.tensors.shard_tokens} tokens this context was built for")
    replicate = u // math.gcd(kv_heads, u)
    if replicate > 1:
        k, v = k.repeat_interleave(replicate, dim=1), v.repeat_interleave(replicate, dim=1)
    if sinks is not None:
        check_sinks(sinks, heads)
        sinks = head_part(sinks, ctx.group)
    features = None if features is None or features.plain else features
    q, k, v = (seq_to_head(t, ctx.group) for t in (q, k, v))
    width = v.shape[-1]                                # latent attention: v padded to q/k's head size (K/V travel stacked)
    kernel = lse_kernel(ctx.backend, q, ctx.bounds)    # the rule's choice for this micro-batch, as an lse form
    if features is not None:                           # a kernel that computes the layer's features
        kernel = feature_lse_kernel(kernel, features, features.positional)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    out = _RingAttention.apply(q, k, widen_values(q, v), ring.tensors, ring.comm, kernel, scale, features, sinks)
    return head_to_seq(narrow_values(out, width), ctx.group)


def ring_context(pool, group, lengths: Sequence[int], rank: int, device: torch.device | str,
                 backend: str = "auto") -> AttentionContext:
    """This rank's attention context for a plan ``group`` with ``group.ring > 1``, from the lengths alone.

    Every rank of the group derives the same zigzag layout from the sequence lengths; the device
    tensors are built once here and reused by every layer. ``flexsp.runtime.shard.group_inputs`` pairs it with the tokens.
    """
    ulysses = group.degree // group.ring
    layout = zigzag_layout(lengths, ulysses, group.ring)
    ulysses_group, ring_group = pool.ring_groups(group.ranks, group.ring)
    _, ring_ranks, ring_index = place(rank, tuple(group.ranks), ulysses)
    tensors = RingTensors.build(layout, ring_index, device)
    return AttentionContext(cu_seqlens=tensors.cu_local[ring_index], max_seqlen=tensors.max_local[ring_index],
                            group=ulysses_group, backend=backend, bounds=tensors.host_local[ring_index],
                            ring=RingContext(RingComm(ring_group, ring_ranks, ring_index), tensors))
