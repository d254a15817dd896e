"""What the step executor needs from a model: ``SPModel``, and the chunked loss every model should use.

The executor calls only ``sp_heads()`` (head checks before a step), ``fsdp_units()`` (what
``prepare_model`` shards one by one; the root is sharded after), ``shard_loss(...)`` and
``parameters()``. ``TinyLM`` implements it; a Hugging Face adapter implements it around a
transformers model. ``shard_loss`` returns a SUM, never a mean: the executor divides by the label
count of the whole global batch, so summed over ranks the gradient is that of the global mean loss.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flexsp.runtime.sp.context import IGNORE_INDEX, AttentionContext

LOSS_CHUNK_TOKENS = 4096   # tokens whose logits exist at once in shard_loss (fp32: 4096 x vocab x 4 bytes)


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
        ``IGNORE_INDEX``; computed in chunks (``chunked_cross_entropy``), never all fp32 logits at once."""
        ...

    def parameters(self, recurse: bool = True): ...


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision models, the model's own dtype when it is wider (fp64 tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_loss(hidden: Tensor, labels: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
    logits = project(hidden)
    return F.cross_entropy(logits.to(loss_dtype(logits.dtype)), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: Tensor, labels: Tensor, project: Callable[[Tensor], Tensor], *,
                          chunk_tokens: int = LOSS_CHUNK_TOKENS) -> Tensor:
    """Sum of cross-entropy of ``project(hidden)`` against ``labels`` (``IGNORE_INDEX`` skipped), in fp32
    (or wider), ``chunk_tokens`` tokens at a time. With more than one chunk each chunk's logits are
    recomputed in backward (activation checkpointing), so at most one chunk's logits are ever alive:
    a 32K-token shard of a 128K-vocabulary model would otherwise hold 16 GiB of fp32 logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    tokens = hidden.shape[0]
    if tokens <= chunk_tokens:
        return _chunk_loss(hidden, labels, project)
    total = None
    for start in range(0, tokens, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            piece = checkpoint(_chunk_loss, hidden[part], labels[part], project, use_reentrant=False)
        else:
            piece = _chunk_loss(hidden[part], labels[part], project)
        total = piece if total is None else total + piece
    return total
