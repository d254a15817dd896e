"""Turn this rank's part of a plan into tensors: fetch a group's items, check them, shard them.

Sharding itself is ``flexsp.runtime.shard.group_inputs`` (the same code the executor runs), so a
loader step and ``StepExecutor.run_plan`` see identical shards.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from flexsp.data.errors import LoaderError
from flexsp.data.source import item_tokens
from flexsp.plan.types import Group
from flexsp.runtime.shard import MicroBatchShard, group_inputs

if TYPE_CHECKING:
    from flexsp.runtime.pool import GroupPool


def to_tokens(item: Any, index: int) -> torch.Tensor:
    """One dataset item as a 1-D int64 tensor (lists, tuples, numpy arrays, tensors, ``input_ids`` dicts)."""
    tokens = item_tokens(item, index)
    if isinstance(tokens, torch.Tensor):
        t = tokens
    else:
        try:
            t = torch.as_tensor(np.asarray(tokens))
        except (TypeError, ValueError) as exc:
            raise LoaderError(f"dataset item {index} cannot be read as token ids: {exc}") from None
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise LoaderError(f"dataset item {index} must be a 1-D sequence of integer token ids, "
                          f"got shape {tuple(t.shape)} dtype {t.dtype}")
    return t.to(torch.long)


def shard_group(fetch: Callable[[int], torch.Tensor], micro_batch: int, group: Group, rank: int,
                indices: Sequence[int], lengths: Sequence[int], device: torch.device | None,
                pool: "GroupPool | None" = None) -> MicroBatchShard:
    """Fetch ``group``'s sequences (plan seq id -> ``indices``), check their lengths, and cut out ``rank``'s
    shard and attention context (``flexsp.runtime.shard.group_inputs``)."""
    seqs = []
    for s in group.seq_ids:
        tokens = fetch(indices[s])
        if tokens.numel() != lengths[s]:
            raise LoaderError(f"dataset item {indices[s]} has {tokens.numel()} tokens but its planned length is "
                              f"{lengths[s]}: the lengths given to the loader are stale or wrong")
        seqs.append(tokens)
    shard, ctx = group_inputs(group, seqs, rank, device if device is not None else "cpu", pool=pool)
    return MicroBatchShard(
        micro_batch=micro_batch, input_ids=shard.input_ids, labels=shard.labels, position_ids=shard.position_ids,
        cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, real_tokens=shard.real_tokens,
        ranks=tuple(group.ranks), local_rank=tuple(group.ranks).index(rank), group=ctx.group,
        indices=tuple(int(indices[s]) for s in group.seq_ids), ring=ctx.ring)
