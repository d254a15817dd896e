"""Run one planned training step on this rank.

For each micro-batch the rank finds its SP group (or idles), packs the group's sequences, runs
forward and backward on its shard, and lets gradients accumulate. Then one all-reduce (sum) over the
whole world - the model is replicated, data parallel over every rank - and one optimizer step. Each
shard's loss is a sum divided by the step's total label count, so the summed gradient equals that of
the mean next-token loss over the global batch on one device, whatever the plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import PlanError
from ..plan import Plan
from .groups import GroupPool
from .packing import IGNORE_INDEX, loss_tokens, pack
from .ring import ring_inputs
from .ulysses import AttentionContext, ShardingError, check_heads


@dataclass(frozen=True)
class StepResult:
    loss: float                       # mean next-token loss over the global batch (same on every rank)
    loss_tokens: int                  # labelled tokens in the global batch: the loss's denominator
    tokens_processed: int             # real (unpadded) tokens in this rank's shards, all micro-batches
    seq_ids: tuple[int, ...]          # sequences run by this rank's groups, in plan order
    degrees: tuple[int | None, ...]   # this rank's group degree per micro-batch; None where it idled
    seconds: float


def validate_step(plan: Plan, lengths: Sequence[int], pool: GroupPool, *,
                  num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
    """Raise ``PlanError`` if ``plan`` cannot run on this world and batch. Local only: no collectives,
    so when every rank sees the same plan every rank raises the same error and none is left waiting."""
    if plan.num_gpus != pool.world_size:
        raise PlanError(f"plan is for {plan.num_gpus} GPUs but the process group has {pool.world_size} ranks")
    unknown = sorted({s for mb in plan.micro_batches for g in mb.groups for s in g.seq_ids
                      if not 0 <= s < len(lengths)})
    if unknown:
        raise PlanError(f"plan references sequence ids {unknown[:8]} but the batch has {len(lengths)} "
                        f"sequences (ids 0..{len(lengths) - 1})")
    plan.validate(lengths=lengths)
    for m, mb in enumerate(plan.micro_batches):
        for j, g in enumerate(mb.groups):
            try:
                pool.check(g.ranks, g.ring)
                if num_heads is not None:   # a ring group splits heads over its Ulysses part only
                    check_heads(num_heads, num_kv_heads or num_heads, g.ulysses)
            except (PlanError, ShardingError) as exc:
                raise PlanError(f"micro-batch {m} group {j}: {exc}") from None
    if loss_tokens(lengths) == 0:
        raise PlanError("the batch has no token with a next-token label (every sequence has length 1)")


class StepExecutor:
    """Executes plans for ``model`` on this rank; build one per rank with the same pool and optimizer type.

    ``model(input_ids, position_ids, ctx) -> logits`` must run on a flat token shard and route its
    attention through ``ulysses_attention(..., ctx)``, like ``flexsp.runtime.model.TinyLM``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, pool: GroupPool, *,
                 backend: str = "auto", num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
        cfg = getattr(model, "cfg", None)
        self.model, self.optimizer, self.pool, self.backend = model, optimizer, pool, backend
        self.num_heads = num_heads if num_heads is not None else getattr(cfg, "num_heads", None)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else getattr(cfg, "num_kv_heads", None)

    def step(self, plan: Plan, batch: Sequence[torch.Tensor]) -> StepResult:
        """One optimizer step on the global ``batch`` (1-D token tensors, indexed by the plan's seq ids).

        Every rank passes the same plan and batch; each touches only its groups' sequences.
        """
        start = time.perf_counter()
        lengths = _lengths(batch)
        validate_step(plan, lengths, self.pool, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        denominator = loss_tokens(lengths)
        device = next(self.model.parameters()).device
        rank = self.pool.rank

        self.optimizer.zero_grad(set_to_none=True)
        local_loss = torch.zeros((), dtype=torch.float64, device=device)
        processed, seq_ids, degrees = 0, [], []
        for mb in plan.micro_batches:
            group = mb.group_of_rank(rank)
            degrees.append(None if group is None else group.degree)
            if group is None:
                continue   # idle this micro-batch; still joins the final all-reduce
            if group.ring > 1:   # Ulysses x ring: zigzag layout, sub-groups from the pool (flexsp.runtime.ring)
                shard, ctx = ring_inputs(self.pool, group, [batch[s] for s in group.seq_ids], rank, device,
                                         self.backend)
            else:
                packed = pack([batch[s].to(device) for s in group.seq_ids], group.degree)
                shard = packed.shard(group.ranks.index(rank))
                ctx = AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                                       group=self.pool.get(group.ranks), backend=self.backend)
            logits = self.model(shard.input_ids, shard.position_ids, ctx)
            loss = F.cross_entropy(logits.float() if logits.dtype.itemsize < 4 else logits, shard.labels,
                                   ignore_index=IGNORE_INDEX, reduction="sum") / denominator
            loss.backward()   # collective inside the group (all-to-all backward): every member gets here
            local_loss += loss.detach().to(torch.float64)
            processed += shard.real_tokens
            seq_ids.extend(group.seq_ids)

        total_loss = _allreduce_grads(self.model, local_loss, self.pool.world_size)
        self.optimizer.step()
        return StepResult(loss=total_loss, loss_tokens=denominator, tokens_processed=processed,
                          seq_ids=tuple(seq_ids), degrees=tuple(degrees), seconds=time.perf_counter() - start)


def _lengths(batch: Sequence[torch.Tensor]) -> list[int]:
    lengths = []
    for i, seq in enumerate(batch):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.numel() == 0:
            shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise PlanError(f"batch[{i}] must be a non-empty 1-D tensor of token ids, got {shape}")
        lengths.append(int(seq.numel()))
    if not lengths:
        raise PlanError("the batch is empty")
    return lengths


def _allreduce_grads(model: nn.Module, local_loss: torch.Tensor, world_size: int) -> float:
    """Sum every gradient (and the loss, for reporting) over the world in a single all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    if world_size == 1:
        return float(local_loss)
    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    dtype = torch.promote_types(dtype, torch.float32)
    # A rank that idled every micro-batch has no gradients: it contributes zeros.
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in params]
                     + [local_loss.reshape(1).to(dtype)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n
    return float(flat[offset])
