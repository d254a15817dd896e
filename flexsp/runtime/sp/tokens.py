"""One rank's tokens (``Shard``) and the token ids every SP axis pads and ignores with.

The bottom of ``flexsp.runtime.sp``: the token layouts (Ulysses packing in ``flexsp.runtime.shard``,
the ring axis's ``zigzag``) build these, and ``context`` (which holds the attention context types)
re-exports them, so no layout module needs the context and the context may name the layouts' types.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexsp.runtime.transfer import to_device

IGNORE_INDEX = -100   # label of tokens that have no next token (sequence ends, padding)
PAD_TOKEN = 0


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
