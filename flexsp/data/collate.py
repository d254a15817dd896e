"""Turn this rank's part of a plan into tensors: fetch a group's items, pack them, keep this rank's shard.

Packing itself is ``flexsp.runtime.token_packing.pack`` (the same code the executor runs), so a loader
step and ``StepExecutor.step`` see identical shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..plan import Group
from ..runtime.token_packing import pack
from ..runtime.zigzag import zigzag_pack
from ..runtime.ulysses import AttentionContext
from .errors import LoaderError
from .source import item_tokens


@dataclass(frozen=True)
class MicroBatchShard:
    """This rank's shard of one SP group in one micro-batch: feed it to the model, backward, repeat.

    Tensors are 1-D over the shard's tokens; ``cu_seqlens`` (int32) bounds the group's sequences in
    the group's full packed stream, as Ulysses attention expects after its all-to-all.
    """

    micro_batch: int                  # index of the micro-batch in the step's plan
    input_ids: torch.Tensor
    labels: torch.Tensor              # IGNORE_INDEX (-100) at sequence ends and padding
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    real_tokens: int                  # tokens of this shard that are data, not padding
    ranks: tuple[int, ...]            # the SP group
    local_rank: int                   # this rank's position in ``ranks``
    group: dist.ProcessGroup | None   # from the GroupPool; None for degree 1 or without a pool
    indices: tuple[int, ...]          # dataset indices of the group's sequences
    ring: Any = None                  # a Ulysses x ring group's RingContext (then group = its Ulysses part)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    def context(self, backend: str = "auto") -> AttentionContext:
        """The ``AttentionContext`` a ``TinyLM``-style model takes for this shard (no host copy: ``cu_seqlens``
        is already on the device)."""
        return AttentionContext(cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, group=self.group,
                                backend=backend, ring=self.ring)


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
                indices: Sequence[int], lengths: Sequence[int], handle: dist.ProcessGroup | None,
                device: torch.device | None, ring: Any = None) -> MicroBatchShard:
    """Fetch ``group``'s sequences (plan seq id -> ``indices``), pack, and cut out ``rank``'s shard."""
    seqs = []
    for s in group.seq_ids:
        tokens = fetch(indices[s])
        if tokens.numel() != lengths[s]:
            raise LoaderError(f"dataset item {indices[s]} has {tokens.numel()} tokens but its planned length is "
                              f"{lengths[s]}: the lengths given to the loader are stale or wrong")
        seqs.append(tokens)
    local = group.ranks.index(rank)
    if group.ring > 1:   # Ulysses x ring: zigzag order; the attention context comes from runtime.ring.ring_context
        packed = zigzag_pack(seqs, group.ulysses, group.ring)
        bounds = packed.layout.cu_local(local // group.ulysses)
        packed_cu, packed_max = bounds, max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    else:
        packed = pack(seqs, group.degree)
        packed_cu, packed_max = packed.cu_seqlens, packed.max_seqlen
    shard = packed.shard(local)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if device is None else t.to(device, non_blocking=True)

    return MicroBatchShard(
        micro_batch=micro_batch, input_ids=move(shard.input_ids), labels=move(shard.labels),
        position_ids=move(shard.position_ids),
        cu_seqlens=move(torch.tensor(packed_cu, dtype=torch.int32)), max_seqlen=packed_max,
        real_tokens=shard.real_tokens, ranks=tuple(group.ranks), local_rank=local, group=handle,
        indices=tuple(int(indices[s]) for s in group.seq_ids), ring=ring)
