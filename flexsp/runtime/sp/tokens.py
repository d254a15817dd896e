"""One rank's tokens (``Shard``) and the token ids every SP axis pads and ignores with.

The bottom of ``flexsp.runtime.sp``: the token layouts (Ulysses packing in ``flexsp.runtime.shard``,
the ring axis's ``zigzag``) build these, and ``context`` (which holds the attention context types)
re-exports them, so no layout module needs the context and the context may name the layouts' types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from flexsp.runtime.transfer import to_device

IGNORE_INDEX = -100   # label of tokens that carry no loss (sequence ends, padding, unsupervised targets)
PAD_TOKEN = 0


def next_token_labels(sequences: Sequence[torch.Tensor], targets: Sequence[torch.Tensor | None] | None,
                      ends: torch.Tensor) -> torch.Tensor:
    """The label of every token of ``sequences`` laid back to back (no padding): the one rule every token
    layout reads (Ulysses packing, the ring's zigzag order), so a label travels with its token.

    Token ``t`` of a sequence is labelled with target ``t + 1`` of the same sequence; its last token with
    ``IGNORE_INDEX``. A sequence's targets are its ``targets`` entry (Hugging Face ``labels``: aligned with
    the tokens, unshifted, ``IGNORE_INDEX`` = no loss; ``flexsp.runtime.labels`` builds them from TRL's masks)
    or, where that is ``None``, its own tokens (plain next-token prediction). ``ends``: the index of each
    sequence's last token in the stream, on the tokens' device (built by the caller, who has the lengths on
    the host). A fixed number of tensor ops, none per sequence."""
    given = list(targets) if targets is not None else [None] * len(sequences)
    if len(given) != len(sequences):
        raise ValueError(f"{len(given)} target rows for {len(sequences)} sequences")
    device = sequences[0].device
    stream = torch.cat([(s if t is None else t).reshape(-1).to(device=device, dtype=torch.long)
                        for s, t in zip(sequences, given)])
    tail = torch.full((1,), IGNORE_INDEX, dtype=torch.long, device=device)
    labels = torch.cat([stream.narrow(0, 1, stream.numel() - 1), tail])
    return labels.index_fill(0, ends, IGNORE_INDEX)   # never across a sequence boundary (out of place)


@dataclass(frozen=True)
class Shard:
    """One rank's tokens of a group (Ulysses packing or a ring group's zigzag slice): its first
    ``real_tokens`` tokens are data, the rest padding."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    real_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "Shard":
        """The shard on ``device`` (three copies per micro-batch, nothing per sequence; from pinned memory
        with ``non_blocking``, ``flexsp.runtime.transfer``)."""
        move = (lambda t: to_device(t, device)) if non_blocking else (lambda t: t.to(device))   # noqa: E731
        return Shard(move(self.input_ids), move(self.position_ids), move(self.labels), self.real_tokens)
