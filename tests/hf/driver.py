"""Test glue: one planned step of an ``SPModel`` on this rank, as the step executor runs it.

Kept to one function so that it switches to ``StepExecutor.run_plan`` once that executor calls
``shard_loss``: for each micro-batch this rank's group packs its sequences, the rank runs its
shard's summed loss / the batch's label count backward, then one all-reduce sums gradients and loss.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from flexsp.plan.types import Plan
from flexsp.runtime import AttentionContext, GroupPool, loss_tokens, pack


def run_step(model, plan: Plan, batch: Sequence[torch.Tensor], pool: GroupPool, backend: str = "sdpa",
             reduce: bool = True):
    """Returns (summed gradient vector over the world, mean loss over the global batch); with
    ``reduce=False`` (FSDP reduces gradients itself) only the loss is summed and no vector is built."""
    denominator = loss_tokens([int(s.numel()) for s in batch])
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for mb in plan.micro_batches:
        group = mb.group_of_rank(pool.rank)
        if group is None:
            continue   # idle this micro-batch
        packed = pack([batch[s] for s in group.seq_ids], group.degree)
        shard = packed.shard(group.ranks.index(pool.rank))
        ctx = AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                               group=pool.get(group.ranks), backend=backend)
        loss = model.shard_loss(shard.input_ids, shard.position_ids, shard.labels, ctx) / denominator
        loss.backward()
        total += loss.detach().to(torch.float64)
    if not reduce:
        if dist.is_initialized():
            dist.all_reduce(total)
        return None, float(total)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
                      for p in params] + [total.reshape(1)])
    if dist.is_initialized():
        dist.all_reduce(flat)
    return flat[:-1], float(flat[-1])
