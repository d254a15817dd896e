"""Turn this rank's part of a plan into tensors: fetch a group's items, check them, shard them.

Sharding itself is ``flexsp.runtime.shard.group_inputs`` (the same code the executor runs), so a
loader step and ``StepExecutor.run_plan`` see identical shards.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from flexsp.data.errors import LoaderError
from flexsp.data.source import item_tokens
from flexsp.plan.types import Group
from flexsp.runtime.labels import integers, out_of_vocabulary, read_targets
from flexsp.runtime.shard import MicroBatchShard, group_inputs

if TYPE_CHECKING:
    from flexsp.runtime.pool import GroupPool


def to_tokens(item: Any, index: int) -> torch.Tensor:
    """One dataset item as a 1-D int64 tensor (lists, tuples, numpy arrays, tensors, ``input_ids`` dicts)."""
    return integers(item_tokens(item, index), f"dataset item {index} (token ids)", LoaderError)


@dataclass(frozen=True)
class Row:
    """One dataset item as the packing step takes it: its tokens, their targets and how many carry loss."""

    input_ids: torch.Tensor           # 1-D int64
    targets: torch.Tensor | None      # aligned, unshifted, -100 = no loss; None: every next token is a target
    supervised: int                   # targets that carry loss (flexsp.runtime.labels.read_targets)


def read_row(item: Any, index: int, vocab_size: int | None = None) -> Row:
    """One dataset item with its supervision: ``labels`` / ``completion_mask`` / ``assistant_masks`` columns
    of a mapping (``flexsp.runtime.labels``); any other item trains every next token."""
    ids = to_tokens(item, index)
    out_of_vocabulary(ids, vocab_size, f"dataset item {index}", LoaderError)
    columns = item if isinstance(item, Mapping) else {}
    targets, supervised = read_targets(columns, ids, f"dataset item {index}", vocab_size)
    return Row(ids, targets, supervised)


def shard_group(fetch: Callable[[int], Row], micro_batch: int, group: Group, rank: int,
                indices: Sequence[int], lengths: Sequence[int], device: torch.device | None,
                pool: "GroupPool | None" = None) -> MicroBatchShard:
    """Fetch ``group``'s rows (plan seq id -> ``indices``), check their lengths, and cut out ``rank``'s
    shard and attention context (``flexsp.runtime.shard.group_inputs``); labels travel with their tokens."""
    rows = []
    for s in group.seq_ids:
        row = fetch(indices[s])
        if row.input_ids.numel() != lengths[s]:
            raise LoaderError(f"dataset item {indices[s]} has {row.input_ids.numel()} tokens but its planned length "
                              f"is {lengths[s]}: the lengths given to the loader are stale or wrong")
        rows.append(row)
    targets = None if all(r.targets is None for r in rows) else [r.targets for r in rows]
    shard, ctx = group_inputs(group, [r.input_ids for r in rows], rank, device if device is not None else "cpu",
                              pool=pool, targets=targets)
    return MicroBatchShard(
        micro_batch=micro_batch, input_ids=shard.input_ids, labels=shard.labels, position_ids=shard.position_ids,
        cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, real_tokens=shard.real_tokens,
        ranks=tuple(group.ranks), local_rank=tuple(group.ranks).index(rank), group=ctx.group,
        indices=tuple(int(indices[s]) for s in group.seq_ids), ring=ctx.ring,
        supervised=sum(r.supervised for r in rows), bounds=ctx.bounds)
