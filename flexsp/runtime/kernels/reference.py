"""The explicit-softmax reference (tests only) and the ``[tokens_q, tokens_k]`` mask it implies.

Neither is a kernel anything runs in training: ``reference`` loops over the sequences on the host,
``block_mask`` is a ``T x T`` tensor. They define what every kernel must compute.
"""
from __future__ import annotations

import math

import torch

from flexsp.runtime.kernels.layout import AttentionError, Bounds


def _segments(cu: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its sequence index (``n`` for padding past ``cu[-1]``) and its distance to that end."""
    n = cu.numel() - 1
    pos = torch.arange(tokens, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu, pos, right=True) - 1            # last bound <= pos: skips empty sequences
    end = cu[(seq + 1).clamp(max=n)]
    return seq, end - pos


def block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens_q: int, tokens_k: int, causal: bool) -> torch.Tensor:
    """``[tokens_q, tokens_k]`` bool: query i may attend key j (same sequence, causal bottom-right).

    A reference for tests and layout checks: no kernel here builds it."""
    if cu_q.numel() != cu_k.numel():
        raise AttentionError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    seq_q, to_end_q = _segments(cu_q, tokens_q)
    seq_k, to_end_k = _segments(cu_k, tokens_k)
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q < cu_q.numel() - 1)[:, None]
    if causal:
        allowed &= to_end_k[None, :] >= to_end_q[:, None]
    return allowed


def causal_seen(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """``[lq, lk]`` bool, bottom-right aligned: query ``i`` of ``lq`` sees key ``j`` iff ``lk - j >= lq - i``."""
    return (lk - torch.arange(lk, device=device))[None, :] >= (lq - torch.arange(lq, device=device))[:, None]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Bounds,
              cu_seqlens_k: Bounds | None = None, *, causal: bool = True, scale: float | None = None,
              return_lse: bool = False, window: int | None = None, chunk: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None):
    """Explicit softmax, one sequence at a time (tests only: a Python loop that reads the bounds).

    Positions are bottom-right aligned (query ``i`` of ``lq`` sits at ``lk - lq + i``). ``window``: keys
    ``p - window < key <= p``; ``chunk``: keys of the query's ``chunk`` block; ``softcap``: scores
    ``softcap * tanh(s / softcap)``; ``sinks [heads]``: an extra zero-value key per head with that logit,
    included in the lse. Written from the definitions, apart from the kernels' own helpers."""
    host = lambda cu: [int(b) for b in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]  # noqa: E731
    bq = host(cu_seqlens_q)
    bk = bq if cu_seqlens_k is None else host(cu_seqlens_k)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    ct = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=ct, device=q.device)
    for i in range(len(bq) - 1):
        (qa, qb), (ka, kb) = (bq[i], bq[i + 1]), (bk[i], bk[i + 1])
        lq, lk = qb - qa, kb - ka
        if lq == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", q[qa:qb], k[ka:kb]).to(ct) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pq = torch.arange(lk - lq, lk, device=q.device)[:, None]
        pk = torch.arange(lk, device=q.device)[None, :]
        seen = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal or window is not None or chunk is not None:
            seen = seen & (pk <= pq)
        if window is not None:
            seen = seen & (pk > pq - window)
        if chunk is not None:
            seen = seen & (pk // chunk == pq // chunk)
        scores = scores.masked_fill(~seen, -math.inf)
        values = v[ka:kb].to(ct)
        if sinks is not None:   # one more key per head: logit sinks[h], value 0
            scores = torch.cat([scores, sinks.to(ct)[:, None, None].expand(-1, lq, 1)], dim=-1)
            values = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
        row_lse = torch.logsumexp(scores, dim=-1)                                   # [h, lq]
        probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out = out.index_add(0, torch.arange(qa, qb, device=q.device),
                            torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype))
        lse = lse.index_copy(1, torch.arange(qa, qb, device=q.device), row_lse)
    return (out, lse) if return_lse else out
