"""Token sharding: a plan group's sequences become this rank's tokens and attention context.

``group_inputs`` is the one place that lays a group's tokens out by SP axis: a Ulysses group packs
its sequences into one stream cut into equal per-rank shards (``pack``); a Ulysses x ring group uses
the zigzag layout (``flexsp.runtime.sp.zigzag``). The loader and the executor both call it, so a
loader step and ``StepExecutor.run_plan`` see identical shards.

Ulysses needs every rank of a group to hold the same number of tokens, so the stream is padded at
the tail to a multiple of the degree. Padding is never real data: it sits past ``cu_seqlens[-1]``
(attention ignores it) and carries the ignore label (the loss ignores it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from flexsp.plan.types import Group
from flexsp.runtime.sp.context import IGNORE_INDEX, PAD_TOKEN, AttentionContext, Shard
from flexsp.runtime.sp.ring import ring_context
from flexsp.runtime.sp.tokens import next_token_labels
from flexsp.runtime.sp.zigzag import zigzag_pack
from flexsp.runtime.transfer import host_tensor

if TYPE_CHECKING:
    from flexsp.runtime.pool import GroupPool


@dataclass(frozen=True)
class PackedGroup:
    """A group's sequences back to back. All tensors are 1-D of length ``padded_tokens``."""

    degree: int
    cu_seqlens: tuple[int, ...]       # sequence bounds in the stream; the last is the real token count
    input_ids: torch.Tensor
    position_ids: torch.Tensor        # restart at 0 per sequence: each is positioned as if alone
    labels: torch.Tensor              # the next token's target inside the same sequence, else IGNORE_INDEX

    @property
    def real_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def shard_tokens(self) -> int:
        return self.padded_tokens // self.degree

    @property
    def max_seqlen(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    def shard(self, local_rank: int) -> "Shard":
        """The contiguous slice ``local_rank`` of ``degree`` holds (Ulysses gathers shards in rank order)."""
        if not 0 <= local_rank < self.degree:
            raise ValueError(f"local rank {local_rank} is outside 0..{self.degree - 1}")
        n = self.shard_tokens
        part = slice(local_rank * n, (local_rank + 1) * n)
        real = max(0, min(n, self.real_tokens - local_rank * n))
        return Shard(self.input_ids[part], self.position_ids[part], self.labels[part], real_tokens=real)

    def context(self, device: torch.device | str | None = None, *, group=None, backend: str = "auto"):
        """The group's ``AttentionContext``: ``cu_seqlens`` copied to ``device`` once, for every layer."""
        return AttentionContext.packed(self.cu_seqlens, device, group=group, backend=backend)


def pack(sequences: Sequence[torch.Tensor], degree: int,
         targets: Sequence[torch.Tensor | None] | None = None) -> PackedGroup:
    """Concatenate 1-D token tensors for a group of ``degree`` ranks, padding the tail.

    ``targets`` (one per sequence, ``None`` = its own tokens): what each token's predecessor is trained to
    predict, as ``flexsp.runtime.sp.tokens.next_token_labels`` reads them (HF ``labels``, -100 = no loss)."""
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    if not sequences:
        raise ValueError("a group needs at least one sequence")
    lengths = [int(s.numel()) for s in sequences]
    if min(lengths) < 1:
        raise ValueError(f"sequences must hold at least one token, got lengths {lengths}")
    real = sum(lengths)
    padded = -(-real // degree) * degree
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    device = sequences[0].device
    # Built with a fixed number of tensor ops whatever the number of sequences (no per-sequence arange).
    # Packing runs where the sequences are (the host, usually; the executor moves the shard); the index
    # tensors derived from host ints go through to_device (pinned + non_blocking): no pageable host-to-device
    # copy, so no host wait, when the sequences already live on a GPU.
    tail = lambda value: torch.full((padded - real,), value, dtype=torch.long, device=device)   # noqa: E731
    ids = torch.cat([*(s.reshape(-1).to(device=device, dtype=torch.long) for s in sequences), tail(PAD_TOKEN)])
    starts = host_tensor(cu[:-1], torch.long, device)
    counts = host_tensor(lengths, torch.long, device)
    restart = torch.repeat_interleave(starts, counts, output_size=real)   # output_size: no device read
    positions = torch.cat([torch.arange(real, device=device) - restart, tail(0)])
    ends = host_tensor(cu[1:], torch.long, device) - 1
    labels = torch.cat([next_token_labels(sequences, targets, ends), tail(IGNORE_INDEX)])
    return PackedGroup(degree=degree, cu_seqlens=tuple(cu), input_ids=ids, position_ids=positions, labels=labels)


def loss_tokens(lengths: Sequence[int]) -> int:
    """Tokens that carry a next-token label when every target is supervised: all but each sequence's last.
    With ``labels`` or a mask the count is the rows' (``flexsp.runtime.labels.read_targets``)."""
    return sum(max(0, int(n) - 1) for n in lengths)


def group_inputs(group: Group, sequences: Sequence[torch.Tensor], rank: int, device: torch.device | str, *,
                 pool: "GroupPool | None" = None, backend: str = "auto",
                 targets: Sequence[torch.Tensor | None] | None = None) -> tuple[Shard, AttentionContext]:
    """This rank's tokens of plan ``group`` (on ``device``) and the attention context every layer uses.

    The one branch on the SP axis of a group's tokens: Ulysses packing, or the zigzag layout of a
    Ulysses x ring group with its ring communicators from ``pool``. Packing runs where the sequences
    are (the host); only the shard moves. Without a pool (one process standing in for a rank of a
    bigger cluster) the context has no process group. ``targets``: as ``pack`` takes them (labels travel
    with their tokens through either layout)."""
    local = tuple(group.ranks).index(rank)
    if group.ring > 1:
        packed = zigzag_pack(sequences, group.ulysses, group.ring, targets)
        if pool is not None:
            ctx = ring_context(pool, group, packed.layout.lengths, rank, device, backend)
        else:
            ctx = AttentionContext.packed(packed.layout.cu_local(local // group.ulysses), device, backend=backend)
    else:
        packed = pack(sequences, group.degree, targets)
        ctx = packed.context(device, group=None if pool is None else pool.get(group.ranks), backend=backend)
    return packed.shard(local).to(device), ctx


@dataclass(frozen=True)
class MicroBatchShard:
    """This rank's shard of one SP group in one micro-batch, as the loader hands it to the executor.

    Tensors are 1-D over the shard's tokens; ``cu_seqlens`` (int32, on the compute device) bounds the
    group's sequences in its packed stream (a ring group: this rank's ring shard), as attention expects.
    """

    micro_batch: int                  # index of the micro-batch in the step's plan
    input_ids: torch.Tensor
    labels: torch.Tensor              # IGNORE_INDEX (-100) at sequence ends, padding and unsupervised targets
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    real_tokens: int                  # tokens of this shard that are data, not padding
    ranks: tuple[int, ...]            # the SP group
    local_rank: int                   # this rank's position in ``ranks``
    group: dist.ProcessGroup | None   # from the GroupPool; None for degree 1 or without a pool
    indices: tuple[int, ...]          # dataset indices of the group's sequences
    ring: Any = None                  # a Ulysses x ring group's RingContext (then group = its Ulysses part)
    supervised: int | None = None     # supervised targets of the group's sequences (every rank of it: the same)
    bounds: tuple[int, ...] | None = None   # ``cu_seqlens`` as host ints (the per-sequence kernels and the rule read these)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    def context(self, backend: str = "auto") -> AttentionContext:
        """The ``AttentionContext`` a ``TinyLM``-style model takes for this shard (no host copy:
        ``cu_seqlens`` is already on the device, its host ints travel beside it)."""
        return AttentionContext(cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, group=self.group,
                                backend=backend, ring=self.ring, bounds=self.bounds)
