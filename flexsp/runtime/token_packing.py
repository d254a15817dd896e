"""Pack one SP group's sequences into a single token stream and cut it into equal per-rank shards.

Ulysses needs every rank of a group to hold the same number of tokens, so the stream is padded at
the tail to a multiple of the degree. Padding is never real data: it sits past ``cu_seqlens[-1]``
(attention ignores it) and carries the ignore label (the loss ignores it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

IGNORE_INDEX = -100   # label of tokens that have no next token (sequence ends, padding)
PAD_TOKEN = 0


@dataclass(frozen=True)
class PackedGroup:
    """A group's sequences back to back. All tensors are 1-D of length ``padded_tokens``."""

    degree: int
    cu_seqlens: tuple[int, ...]       # sequence bounds in the stream; the last is the real token count
    input_ids: torch.Tensor
    position_ids: torch.Tensor        # restart at 0 per sequence: each is positioned as if alone
    labels: torch.Tensor              # next token inside the same sequence, else IGNORE_INDEX

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
        from .ulysses import AttentionContext
        return AttentionContext.packed(self.cu_seqlens, device, group=group, backend=backend)


@dataclass(frozen=True)
class Shard:
    """One rank's part of a packed group; its first ``real_tokens`` tokens are data, the rest padding."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    real_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "Shard":
        """The shard on ``device`` (three copies per micro-batch, nothing per sequence)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)   # noqa: E731
        return Shard(move(self.input_ids), move(self.position_ids), move(self.labels), self.real_tokens)


def pack(sequences: Sequence[torch.Tensor], degree: int) -> PackedGroup:
    """Concatenate 1-D token tensors for a group of ``degree`` ranks, padding the tail."""
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
    # Built with a fixed number of tensor ops whatever the number of sequences (no per-sequence arange);
    # pack on the host and move the shard, not each sequence, to the device.
    ids = torch.full((padded,), PAD_TOKEN, dtype=torch.long, device=device)
    ids[:real] = torch.cat([s.reshape(-1).to(device=device, dtype=torch.long) for s in sequences])
    starts = torch.tensor(cu[:-1], dtype=torch.long, device=device)
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    positions = torch.zeros(padded, dtype=torch.long, device=device)
    positions[:real] = torch.arange(real, device=device) - torch.repeat_interleave(starts, counts, output_size=real)
    labels = torch.full((padded,), IGNORE_INDEX, dtype=torch.long, device=device)
    labels[:real - 1] = ids[1:real]
    labels[torch.tensor(cu[1:], device=device) - 1] = IGNORE_INDEX   # a sequence's last token predicts nothing
    return PackedGroup(degree=degree, cu_seqlens=tuple(cu), input_ids=ids, position_ids=positions, labels=labels)


def loss_tokens(lengths: Sequence[int]) -> int:
    """Tokens that carry a next-token label: every token but the last of each sequence."""
    return sum(max(0, int(n) - 1) for n in lengths)
