"""What every attention layer of one forward pass needs: ``AttentionContext`` (the SP group and the
packed layout) with its ring half ``RingContext``, and the head-divisibility rule; the token ids every
SP axis pads and ignores with and ``Shard``, one rank's tokens, are re-exported from ``tokens``.

The context is built once per micro-batch (``AttentionContext.packed`` or the ring axis's
``ring_context``) and handed to every layer; ``flexsp.runtime.sp.attention.sp_attention`` reads it to
decide which SP axis serves the group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch
import torch.distributed as dist

from flexsp.errors import FlexSPError
from flexsp.runtime.sp.ring_comm import RingComm
from flexsp.runtime.sp.tokens import IGNORE_INDEX, PAD_TOKEN, Shard
from flexsp.runtime.sp.ulysses_comm import AllToAllExchange, Exchange
from flexsp.runtime.sp.zigzag import RingTensors
from flexsp.runtime.transfer import host_tensor

__all__ = ["AttentionContext", "RingContext", "ShardingError", "check_heads", "IGNORE_INDEX", "PAD_TOKEN", "Shard"]


@dataclass(frozen=True)
class RingContext:
    """The ring half of an ``AttentionContext``: this rank's place on its ring and the block layout."""

    comm: RingComm
    tensors: RingTensors

    @property
    def size(self) -> int:
        return self.comm.size


class ShardingError(FlexSPError):
    """The model's heads cannot be split over the SP degree asked for."""


@dataclass(frozen=True)
class AttentionContext:
    """What every attention layer of one forward pass needs: the SP group and the packed layout.

    ``cu_seqlens`` (int32, on the compute device) bounds the group's real sequences in its full
    packed stream (not this shard); it is built once per micro-batch (``packed``) so no layer copies
    or reads it on the host. ``max_seqlen`` is a host int for the kernels. ``group`` is None for degree 1.
    ``ring`` (a ``RingContext``) is set for a Ulysses x ring group: then ``group``
    is the Ulysses sub-group and ``cu_seqlens`` bounds this rank's ring shard.
    ``exchange`` replaces the all-to-all over ``group`` (replay's local stand-in); None means the real one.
    ``bounds``: ``cu_seqlens`` as host ints (the per-sequence kernels read these, never the device tensor);
    None where only the device copy exists - then a CPU ``cu_seqlens`` is read directly.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    group: dist.ProcessGroup | None = None
    backend: str = "auto"
    ring: RingContext | None = None
    exchange: Exchange | None = None
    bounds: tuple[int, ...] | None = None

    @property
    def trades(self) -> Exchange:
        return self.exchange if self.exchange is not None else AllToAllExchange(self.group)

    @property
    def degree(self) -> int:
        return self.trades.degree

    @cached_property
    def cu_seqlens_int64(self) -> torch.Tensor:
        """``cu_seqlens`` as int64 (flash-linear-attention's bounds type), cast once per micro-batch on the device:
        every layer gets the same tensor, so fla's caches keyed on it hit instead of redoing (and syncing) per layer."""
        return self.cu_seqlens.long()

    @classmethod
    def packed(cls, bounds: Sequence[int], device: torch.device | str | None = None, *,
               group: dist.ProcessGroup | None = None, backend: str = "auto") -> "AttentionContext":
        """The context of a packed stream whose sequences end at the host ints ``bounds`` (``[0, ..., real]``):
        one host-to-device copy of ``cu_seqlens`` here, none in the layers."""
        bounds = [int(b) for b in bounds]
        if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 and bound at least one sequence, got {bounds}")
        cu = host_tensor(bounds, torch.int32, device)   # pinned + non_blocking to CUDA: no host wait
        max_seqlen = max(b - a for a, b in zip(bounds, bounds[1:]))
        return cls(cu_seqlens=cu, max_seqlen=max_seqlen, group=group, backend=backend, bounds=tuple(bounds))

    @classmethod
    def single(cls, tokens: int, backend: str = "auto", device: torch.device | str | None = None) -> "AttentionContext":
        """One causal sequence on one device (no packing, no SP)."""
        return cls.packed((0, tokens), device, backend=backend)


def check_heads(heads: int, kv_heads: int, degree: int) -> None:
    """Raise ``ShardingError`` unless ``degree`` ranks can split ``heads`` query heads evenly.

    Any divisor of the heads works (3 of 6 or 12 heads included); kv heads need not divide: Ulysses
    replicates each kv head just enough (``degree / gcd(kv_heads, degree)`` copies) for every rank to
    hold the ones its query heads use."""
    if heads % degree:
        usable = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ShardingError(f"Ulysses SP degree {degree} does not divide the {heads} attention heads; "
                            f"this model's Ulysses parts are the divisors {usable} (at most {max(usable)}); "
                            f"a larger group runs Ulysses gcd(degree, heads) x ring")
    if heads % kv_heads:
        raise ShardingError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
