"""What the step executor needs from a model: ``SPModel`` (the loss every model should use is ``loss.py``'s).

The executor calls only ``sp_heads()`` (head checks before a step), ``fsdp_units()`` (what
``prepare_model`` shards one by one; the root is sharded after), ``shard_loss(...)`` and
``parameters()``. ``TinyLM`` implements it; a Hugging Face adapter implements it around a
transformers model. ``shard_loss`` returns a SUM, never a mean: the executor divides by the label
count of the whole global batch, so summed over ranks the gradient is that of the global mean loss.
A model whose auxiliary loss couples the whole batch (a MoE router's) also sets ``batch_coupled`` and
implements ``shard_losses`` / ``batch_statistics`` (``flexsp.runtime.coupled``).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from flexsp.runtime.sp.context import AttentionContext


@runtime_checkable
class SPModel(Protocol):
    """A decoder whose attention runs through ``sp_attention(..., ctx)`` and everything else per token."""

    def sp_heads(self) -> tuple[int, int]:
        """(query heads, kv heads): an SP degree must divide the query heads."""
        ...

    def fsdp_units(self) -> Sequence[nn.Module]:
        """Submodules to ``fully_shard`` one by one (the decoder layers); the root is sharded after them."""
        ...

    def shard_loss(self, input_ids: Tensor, position_ids: Tensor, labels: Tensor, ctx: AttentionContext) -> Tensor:
        """fp32 scalar: SUM of next-token cross-entropy over this shard's tokens whose label is not
        ``IGNORE_INDEX``; computed in chunks (``linear_cross_entropy``), never all fp32 logits at once."""
        ...

    def parameters(self, recurse: bool = True): ...


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision models, the model's own dtype when it is wider (fp64 tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)
