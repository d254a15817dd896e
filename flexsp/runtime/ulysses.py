"""Ulysses sequence parallelism: trade a token shard for a head shard, attend locally, trade back.

Each of the group's ``d`` ranks holds ``[tokens/d, heads, dim]``. One all-to-all gives it every
token of ``heads/d`` heads, so plain local attention over the packed sequences is exact; a second
all-to-all restores the token shard. Communication lives in ``comm``, kernels in ``attention``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..errors import FlexSPError
from .attention import attend
from .comm import head_to_seq, seq_to_head


class ShardingError(FlexSPError):
    """The model's heads cannot be split over the SP degree asked for."""


class Exchange(Protocol):
    """The two Ulysses trades one rank makes. Training uses ``AllToAllExchange``; ``flexsp.replay``
    substitutes a local stand-in that yields the same post-exchange shapes without a process group."""

    @property
    def degree(self) -> int: ...

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor: ...   # [tokens/d, heads, dim] -> [tokens, heads/d, dim]

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor: ...   # the inverse


@dataclass(frozen=True)
class AllToAllExchange:
    """The real exchange: an autograd all-to-all over the SP group (identity for None / size 1)."""

    group: dist.ProcessGroup | None

    @property
    def degree(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor:
        return seq_to_head(x, self.group)

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        return head_to_seq(x, self.group)


@dataclass(frozen=True)
class AttentionContext:
    """What every attention layer of one forward pass needs: the SP group and the packed layout.

    ``cu_seqlens`` bounds the group's real sequences in its full packed stream (not this shard);
    ``group`` is None for degree 1. ``exchange`` replaces the all-to-all over ``group`` (replay's
    local stand-in); None means the real one.
    """

    cu_seqlens: tuple[int, ...]
    max_seqlen: int
    group: dist.ProcessGroup | None = None
    backend: str = "auto"
    exchange: Exchange | None = None

    @property
    def trades(self) -> Exchange:
        return self.exchange if self.exchange is not None else AllToAllExchange(self.group)

    @property
    def degree(self) -> int:
        return self.trades.degree

    @classmethod
    def single(cls, tokens: int, backend: str = "auto") -> "AttentionContext":
        """One causal sequence on one device (no packing, no SP)."""
        return cls(cu_seqlens=(0, tokens), max_seqlen=tokens, backend=backend)


def check_heads(heads: int, kv_heads: int, degree: int) -> None:
    """Raise ``ShardingError`` unless ``degree`` ranks can split ``heads`` query heads evenly."""
    if heads % degree:
        usable = [d for d in (1 << i for i in range(heads.bit_length())) if heads % d == 0]
        raise ShardingError(f"Ulysses SP degree {degree} does not divide the {heads} attention heads; "
                            f"this model supports SP degrees {usable} (at most {max(usable)})")
    if heads % kv_heads:
        raise ShardingError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Causal attention of this rank's token shard over its SP group; returns ``q``'s shape.

    ``q [tokens/d, heads, dim]``, ``k``/``v`` ``[tokens/d, kv_heads, dim]``. With fewer kv heads than
    ranks (GQA/MQA) each kv head is replicated just enough for every rank to hold the ones its query
    heads use; the gradient of the copies sums back into the original head.
    """
    d = ctx.degree
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, d)
    if d == 1:
        return attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend)
    if ctx.cu_seqlens[-1] > q.shape[0] * d:
        raise ValueError(f"cu_seqlens covers {ctx.cu_seqlens[-1]} tokens but {d} shards of {q.shape[0]} hold "
                         f"{q.shape[0] * d}")
    # Replicate kv heads r times so d divides them; r divides heads/kv_heads because d divides heads.
    r = d // math.gcd(kv_heads, d)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    trades = ctx.trades
    q, k, v = (trades.seq_to_head(t) for t in (q, k, v))
    out = attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend)
    return trades.head_to_seq(out)
