"""Ulysses sequence parallelism: trade a token shard for a head shard, attend locally, trade back.

Each of the group's ``d`` ranks holds ``[tokens/d, heads, dim]``. One all-to-all gives it every
token of ``heads/d`` heads, so plain local attention over the packed sequences is exact; a second
all-to-all restores the token shard. Communication lives in ``comm``, kernels in ``attention``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

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

    ``cu_seqlens`` (int32, on the compute device) bounds the group's real sequences in its full
    packed stream (not this shard); it is built once per micro-batch (``packed``) so no layer copies
    or reads it on the host. ``max_seqlen`` is a host int for the kernels. ``group`` is None for degree 1.
    ``ring`` (a ``flexsp.runtime.ring.RingContext``) is set for a Ulysses x ring group: then ``group``
    is the Ulysses sub-group and ``cu_seqlens`` bounds this rank's ring shard.
    ``exchange`` replaces the all-to-all over ``group`` (replay's local stand-in); None means the real one.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    group: dist.ProcessGroup | None = None
    backend: str = "auto"
    ring: "RingContext | None" = None   # noqa: F821 - flexsp.runtime.ring.RingContext
    exchange: Exchange | None = None

    @property
    def trades(self) -> Exchange:
        return self.exchange if self.exchange is not None else AllToAllExchange(self.group)

    @property
    def degree(self) -> int:
        return self.trades.degree

    @classmethod
    def packed(cls, bounds: Sequence[int], device: torch.device | str | None = None, *,
               group: dist.ProcessGroup | None = None, backend: str = "auto") -> "AttentionContext":
        """The context of a packed stream whose sequences end at the host ints ``bounds`` (``[0, ..., real]``):
        one host-to-device copy of ``cu_seqlens`` here, none in the layers."""
        bounds = [int(b) for b in bounds]
        if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 and bound at least one sequence, got {bounds}")
        cu = torch.tensor(bounds, dtype=torch.int32)
        if device is not None and torch.device(device).type != "cpu":
            cu = cu.pin_memory().to(device, non_blocking=True) if torch.cuda.is_available() else cu.to(device)
        max_seqlen = max(b - a for a, b in zip(bounds, bounds[1:]))
        return cls(cu_seqlens=cu, max_seqlen=max_seqlen, group=group, backend=backend)

    @classmethod
    def single(cls, tokens: int, backend: str = "auto", device: torch.device | str | None = None) -> "AttentionContext":
        """One causal sequence on one device (no packing, no SP)."""
        return cls.packed((0, tokens), device, backend=backend)


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
    heads use; the gradient of the copies sums back into the original head. No host sync: the
    layout was checked when the context was built (``pack`` sizes the shards to cover ``cu_seqlens``).
    """
    if ctx.ring is not None:
        from .ring import ring_attention
        return ring_attention(q, k, v, ctx)
    d = ctx.degree
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, d)
    if d == 1:
        return attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend)
    # Replicate kv heads r times so d divides them; r divides heads/kv_heads because d divides heads.
    r = d // math.gcd(kv_heads, d)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    trades = ctx.trades
    q, k, v = (trades.seq_to_head(t) for t in (q, k, v))
    out = attend(q, k, v, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, backend=ctx.backend)
    return trades.head_to_seq(out)
