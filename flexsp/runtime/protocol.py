"""What the step executor needs from a model: the ``SPModel`` protocol.

Minimal copy on this branch so ``flexsp.hf`` imports; the runtime's own version is authoritative.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .ulysses import AttentionContext


@runtime_checkable
class SPModel(Protocol):
    def sp_heads(self) -> tuple[int, int]:
        """(query heads, kv heads): which SP degrees the model's heads allow."""
        ...

    def fsdp_units(self) -> Sequence[nn.Module]:
        """Submodules to ``fully_shard`` one by one (the decoder layers); the root is sharded after."""
        ...

    def shard_loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                   ctx: AttentionContext) -> torch.Tensor:
        """fp32 scalar: SUM of next-token cross-entropy over this shard's tokens whose label != -100;
        chunked, never the whole shard's fp32 logits at once."""
        ...
