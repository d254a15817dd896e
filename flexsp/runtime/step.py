"""Run one planned training step on this rank: the only step path (the loader's ``Step`` or a plan + batch).

1. **Check, locally**: plan against the pool and world, ring groups, heads, the cost model's
   capacity and sharding, and (for a loader ``Step``) that this rank's shards are the plan's.
2. **Agree** (``failures.agree``): one flag all-reduce that every rank reaches; if any rank's checks
   failed, every rank raises the same error and nobody has entered a step collective.
3. **Run every micro-batch on every rank**: a member of a group runs its shard through
   ``model.shard_loss`` (Ulysses all-to-alls inside its group); a rank idle in a micro-batch runs a
   one-token dummy with loss weight 0, so it joins every FSDP all-gather and reduce-scatter in the
   same order as the others. Gradients are reduce-scattered per layer during backward (FSDP2) and
   accumulate over micro-batches; a model that was not prepared is all-reduced at the end, in buckets of at most 25 MiB.
4. **One optimizer step.** A failure after step collectives began is recorded for every rank
   (``failures.FailureChannel``) and raised everywhere as the same ``RankFailure``.

Each shard's loss is a sum over its supervised targets divided by the global batch's count of them
(``step_loss``: Hugging Face's ``num_items_in_batch``), so the summed gradient equals that of the mean
next-token loss over the global batch's supervised targets on one device, whatever the plan. A batch with
no supervised target at all runs as a zero-loss step (zero gradients, logged), never 0/0. A model with a
batch-coupled auxiliary loss (a MoE router's load balancing, ``flexsp.runtime.coupled``) adds its
shard's term apart, computed from statistics summed over the whole batch (one small all-reduce).
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from types import MappingProxyType
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flexsp.errors import FlexSPError, PlanError
from flexsp.plan import memory as sharding_mod
from flexsp.plan.cost import CostModel
from flexsp.plan.cluster import is_tile_start
from flexsp.plan.types import Group, PlacedGroups, Plan, per_degree
from flexsp.runtime.config import TrainConfig
from flexsp.runtime.coupled import BatchCoupled, batch_coupled
from flexsp.runtime.failures import FailureChannel, RankFailure, agree
from flexsp.runtime.fsdp import is_sharded, runtime_sharding, step_autocast
from flexsp.runtime.labels import integers, out_of_vocabulary, read_targets
from flexsp.runtime.pool import GroupPool
from flexsp.runtime.probe import NO_PROBE, StepProbe
from flexsp.runtime.shard import MicroBatchShard, group_inputs, loss_tokens
from flexsp.runtime.sp.context import IGNORE_INDEX, PAD_TOKEN, AttentionContext, ShardingError, check_heads


# dataclass field metadata: the field holds no device tensor (``flexsp.data.prefetch.device_tensors`` skips it)
HOST_ONLY = MappingProxyType({"host_only": True})


@dataclass(frozen=True)
class Step:
    """What this rank runs in one optimizer step, as ``flexsp.data.FlexSPLoader`` yields it and
    ``StepExecutor.step`` consumes it. Same ``plan``, ``indices`` and token counts on every rank."""

    epoch: int
    index: int                                  # global batch within the epoch
    step: int                                   # steps taken by this loader's run, resumes included
    # host-only fields (``HOST_ONLY``): a walk for the step's device tensors skips them (131,072 ints each at scale)
    plan: Plan = field(metadata=HOST_ONLY)      # seq id i of the plan is dataset item ``indices[i]``
    indices: tuple[int, ...] = field(metadata=HOST_ONLY)
    lengths: tuple[int, ...] = field(metadata=HOST_ONLY)
    num_tokens: int                             # real tokens in the global batch
    loss_tokens: int                            # supervised targets in the global batch: divide summed losses by it
    micro_batches: tuple[MicroBatchShard, ...]  # only those this rank takes part in, in plan order
    last: bool                                  # the epoch's final batch
    plan_wait: float                            # seconds the loop blocked for its plan (incl. broadcast)
    load_seconds: float                         # ... and for fetching and packing (prefetched: what was not ready)
    fallback: bool                              # planned by the greedy fallback after a slow solve
    sharding: str = "full"                      # model-state sharding the cost model's capacity assumed


@dataclass(frozen=True)
class StepResult:
    loss: float                       # mean next-token loss over the global batch's supervised targets (every
                                      # rank), plus aux_loss
    loss_tokens: int                  # supervised targets in the global batch: the loss's denominator
    tokens_processed: int             # real (unpadded) tokens in this rank's shards, all micro-batches
    seq_ids: tuple[int, ...]          # sequences run by this rank's groups, in plan order
    degrees: tuple[int | None, ...]   # this rank's group degree per micro-batch; None where it idled
    seconds: float
    aux_loss: float = 0.0             # the part of ``loss`` from a batch-coupled auxiliary loss (a MoE router's)


@dataclass(frozen=True)
class _Work:
    """One micro-batch of this rank, on the compute device; ``None`` in a work list means idle."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    ctx: AttentionContext
    real_tokens: int
    group: Group


log = logging.getLogger("flexsp.step")


def step_loss(token_loss_sum: torch.Tensor, supervised: int) -> torch.Tensor:
    """A shard's part of the step's loss: its summed next-token loss over the global batch's supervised
    targets (HF's ``num_items_in_batch``). Summed over shards, micro-batches and ranks this is the mean over
    the global batch on one device. The one place the loss is normalised (a second term, e.g. a router
    auxiliary loss, is added here). With no supervised target in the whole batch every shard's sum is an
    exact zero and so is the result (divided by 1, not 0: no NaN)."""
    return token_loss_sum / max(int(supervised), 1)


def validate_step(plan: Plan, lengths: Sequence[int], pool: GroupPool, *, num_heads: int | None = None,
                  num_kv_heads: int | None = None, cost: CostModel | None = None) -> None:
    """Raise ``PlanError`` if ``plan`` cannot run on this world and batch. Local only: no collectives.

    Every rank runs this every step, so a plan from ``plan_batch`` (groups as ``PlacedGroups`` columns) is
    checked on arrays, and only a group they flag is checked (and named) one by one, as any other plan's
    groups are: a 16,384-GPU plan's 131,072 groups are not built as objects here."""
    if not isinstance(plan, Plan):
        raise PlanError(f"expected a flexsp.Plan, got {type(plan).__name__}")
    if plan.num_gpus != pool.world_size:
        raise PlanError(f"plan is for {plan.num_gpus} GPUs but the process group has {pool.world_size} ranks")
    unknown = sorted(_unknown_ids(plan, len(lengths)))
    if unknown:
        raise PlanError(f"plan references sequence ids {unknown[:8]} but the batch has {len(lengths)} "
                        f"sequences (ids 0..{len(lengths) - 1})")
    plan.validate(lengths=lengths)
    as_array = np.asarray(lengths, dtype=np.int64)         # once, not per micro-batch
    for m, mb in enumerate(plan.micro_batches):
        groups = mb.groups
        if isinstance(groups, PlacedGroups):
            for j in _flagged(groups, as_array, pool, num_heads, num_kv_heads, cost).tolist():
                _check_group(m, j, groups.group(j), lengths, pool, num_heads, num_kv_heads, cost)
        else:
            for j, g in enumerate(groups):
                _check_group(m, j, g, lengths, pool, num_heads, num_kv_heads, cost)


def _unknown_ids(plan: Plan, count: int) -> set:
    """Sequence ids of ``plan`` outside ``0..count-1``."""
    out: set = set()
    for mb in plan.micro_batches:
        if isinstance(mb.groups, PlacedGroups):
            ids = mb.groups.ids
            out.update(ids[(ids < 0) | (ids >= count)].tolist())
        else:
            out.update(s for g in mb.groups for s in g.seq_ids if not 0 <= s < count)
    return out


def _check_group(m: int, j: int, g: Group, lengths: Sequence[int], pool: GroupPool, num_heads: int | None,
                 num_kv_heads: int | None, cost: CostModel | None) -> None:
    """``validate_step``'s checks of one group: pooled, heads split evenly, within memory."""
    try:
        pool.check(g.ranks, g.ring)
        if num_heads is not None:   # a ring group splits heads over its Ulysses part only
            check_heads(num_heads, num_kv_heads or num_heads, g.ulysses)
    except (PlanError, ShardingError) as exc:
        raise PlanError(f"micro-batch {m} group {j}: {exc}") from None
    if cost is not None:
        tokens = sum(int(lengths[s]) for s in g.seq_ids)
        if tokens > cost.group_capacity(g.degree):
            raise PlanError(f"micro-batch {m} group {j} holds {tokens} tokens on {g.degree} GPUs, more than "
                            f"the cost model's capacity {cost.group_capacity(g.degree):.0f} "
                            f"({cost.token_capacity:.0f} per GPU): it would run out of memory")


def _flagged(groups: PlacedGroups, lengths: np.ndarray, pool: GroupPool, num_heads: int | None,
             num_kv_heads: int | None, cost: CostModel | None) -> np.ndarray:
    """Positions of the groups ``_check_group`` would refuse, found on the columns (each check once per
    distinct degree, split or Ulysses part); ascending, so the first raises as the loop over groups would.
    Runs after ``Plan.validate``: every group has ranks and sequences."""
    if pool.closed:
        return np.arange(min(1, len(groups)))
    degrees, rings = groups.degrees, groups.rings
    bad = ~(np.isin(degrees, list(pool.degrees))
            & is_tile_start(groups.first_ranks, degrees, pool.world_size, pool.gpus_per_node))
    for d, r in set(zip(degrees.tolist(), rings.tolist())):
        if r > 1 and (d // r, r) not in pool.splits:
            bad |= (degrees == d) & (rings == r)
    if num_heads is not None:
        ulysses = degrees // rings
        for u in set(ulysses.tolist()):
            try:
                check_heads(num_heads, num_kv_heads or num_heads, u)
            except (PlanError, ShardingError):
                bad |= ulysses == u
    if cost is not None:
        tokens = np.add.reduceat(lengths[groups.ids], np.cumsum(groups.sizes) - groups.sizes)
        bad |= tokens > per_degree(degrees, cost.group_capacity)
    return np.flatnonzero(bad)


class StepExecutor:
    """Executes planned steps of ``model`` (an ``SPModel``) on this rank; build one per rank, in the same order.

    ``cost``: the cost model the plans came from; its capacity is checked per group and its recorded
    sharding must not exceed what ``model`` runs (``flexsp.plan.memory.check_runtime``).
    ``config`` (a ``TrainConfig``; keyword ``settings`` such as ``backend="sdpa"`` override it) gives the
    attention kernel. ``failure_name`` keys this executor's failure record in the job's store (unique
    per executor). ``probe`` (a ``flexsp.runtime.probe.StepProbe``, e.g. ``flexsp.telemetry.StepRecorder``)
    is called at the step's begin, agreement, micro-batch boundaries and end to measure it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, pool: GroupPool, *,
                 cost: CostModel | None = None, config: TrainConfig | None = None, failure_name: str = "executor",
                 probe: StepProbe | None = None, **settings: Any) -> None:
        if not callable(getattr(model, "shard_loss", None)) or not callable(getattr(model, "sp_heads", None)):
            raise FlexSPError(f"{type(model).__name__} is not an SPModel (flexsp.runtime.models.protocol): it needs "
                              f"sp_heads(), fsdp_units() and shard_loss()")
        # wrong types named here, not as an AttributeError deep in the first step
        if cost is not None and not isinstance(cost, CostModel):
            raise FlexSPError(f"cost must be a flexsp.CostModel or None, got {type(cost).__name__}")
        if not hasattr(pool, "world_size") or not hasattr(pool, "rank"):
            raise FlexSPError(f"pool must be a flexsp.runtime.GroupPool, got {type(pool).__name__}")
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise FlexSPError(f"optimizer must be a torch optimizer (step() and zero_grad()), got {type(optimizer).__name__}")
        self.config = TrainConfig.of(config, settings)
        self.model, self.optimizer, self.pool, self.backend, self.cost = model, optimizer, pool, self.config.backend, cost
        self.num_heads, self.num_kv_heads = model.sp_heads()
        if self.config.recompute is not None and callable(getattr(model, "set_recompute", None)):
            model.set_recompute(self.config.recompute)
        self.sharding = runtime_sharding(model)
        if cost is not None:
            sharding_mod.check_runtime(sharding_mod.assumed(cost), self.sharding)
        self.device = next(model.parameters()).device
        self.sharded = is_sharded(model)
        # the compute dtype: what shard_model prepared, or config.param_dtype applied by autocast (PrecisionError
        # where it cannot be); never silently the parameters' fp32 when a config asked for bf16
        explicit = config is not None or "param_dtype" in settings
        self.autocast = step_autocast(model, self.config.param_dtype, explicit)
        unprepared_fp32 = runtime_sharding(model, None) is None and next(model.parameters()).dtype == torch.float32
        if not explicit and self.autocast is None and self.device.type == "cuda" and unprepared_fp32:
            warnings.warn("StepExecutor: this model computes in fp32 on CUDA (no config, not prepared by shard_model): "
                          "pass config=TrainConfig(param_dtype=torch.bfloat16) for bf16 autocast, or param_dtype=None "
                          "to keep fp32 without this warning", stacklevel=2)
        self.channel = FailureChannel(failure_name) if pool.world_size > 1 else None
        self.steps = 0
        self._dummy: _Work | None = None
        self.probe = probe if probe is not None else NO_PROBE

    def close(self) -> None:
        """Stop the failure watcher thread; call at the end of training (or use ``with``), before
        ``pool.close()``. Idempotent; one left open is stopped at exit by the pool's teardown."""
        if self.channel is not None:
            self.channel.close()

    def __enter__(self) -> "StepExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- entry points ---------------------------------------------------------------------------
    def step(self, step: Step) -> StepResult:
        """One optimizer step on the loader's per-rank ``Step`` (every rank passes its own)."""
        error, work = None, []
        self.probe.step_begin(step.plan, step)
        try:
            work = self._check_loader_step(step)
        except Exception as exc:
            error = exc
        self._agree(error)
        return self._run(work, step.loss_tokens)

    def run_plan(self, plan: Plan, batch: Sequence[Any]) -> StepResult:
        """One optimizer step on the global ``batch``, indexed by the plan's seq ids: 1-D token tensors, or
        mappings with ``input_ids`` and a ``labels`` / ``completion_mask`` / ``assistant_masks`` column
        (``flexsp.runtime.labels``: which targets carry loss).

        Every rank passes the same plan and batch; each packs and runs only its groups' sequences.
        """
        error, work, denominator = None, [], 0
        self.probe.step_begin(plan, batch)
        try:
            tokens, targets, denominator = _rows(batch, _vocab_size(self.model))
            lengths = [int(t.numel()) for t in tokens]
            validate_step(plan, lengths, self.pool, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          cost=self.cost)
            work = [self._pack(tokens, targets, mb.group_of_rank(self.pool.rank)) for mb in plan.micro_batches]
        except Exception as exc:
            error = exc
        self._agree(error)
        return self._run(work, denominator)

    # --- checks (local) -------------------------------------------------------------------------
    def _check_loader_step(self, step: Step) -> list[_Work | None]:
        plan, lengths, rank = step.plan, step.lengths, self.pool.rank
        validate_step(plan, lengths, self.pool, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                      cost=self.cost)
        assumed = getattr(step, "sharding", None)
        if assumed is not None:
            sharding_mod.check_runtime(assumed, self.sharding)
        if not 0 <= step.loss_tokens <= loss_tokens(lengths):
            raise PlanError(f"step says {step.loss_tokens} supervised targets but its lengths have room for "
                            f"0..{loss_tokens(lengths)}")
        shards = list(step.micro_batches)
        work: list[_Work | None] = []
        for m, mb in enumerate(plan.micro_batches):
            group = mb.group_of_rank(rank)
            if group is None:
                work.append(None)
                continue
            if not shards or shards[0].micro_batch != m:
                got = shards[0].micro_batch if shards else "none"
                raise PlanError(f"the step has no shard for micro-batch {m} of its plan (next shard is "
                                f"for micro-batch {got}): the step's shards do not match its plan")
            shard = shards.pop(0)
            work.append(self._check_shard(m, group, shard, lengths))
        if shards:
            raise PlanError(f"the step has shards for micro-batches {[s.micro_batch for s in shards]} "
                            f"where its plan gives this rank no group")
        return work

    def _check_shard(self, m: int, group: Group, shard: MicroBatchShard, lengths: Sequence[int]) -> _Work:
        rank, where = self.pool.rank, f"micro-batch {m}"
        if tuple(shard.ranks) != tuple(group.ranks) or shard.local_rank != group.ranks.index(rank):
            raise PlanError(f"{where}: shard is for ranks {list(shard.ranks)} (position {shard.local_rank}) but the "
                            f"plan puts this rank in {list(group.ranks)}")
        ring = group.ring > 1
        handle = self.pool.ring_groups(group.ranks, group.ring)[0] if ring else self.pool.get(group.ranks)
        if shard.group is not handle or (ring and getattr(shard, "ring", None) is None):
            raise PlanError(f"{where}: the shard's process group is not the pool's group for {list(group.ranks)}; "
                            f"build the loader with the executor's pool")
        total = sum(int(lengths[s]) for s in group.seq_ids)
        # a ring group's zigzag shard pads each sequence to 2 x ring chunks: its length is the layout's
        expect = shard.input_ids.numel() if ring else -(-total // group.degree)
        for name in ("input_ids", "position_ids", "labels"):
            t = getattr(shard, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != expect:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise PlanError(f"{where}: shard {name} must be 1-D with {expect} tokens ({total} tokens over "
                                f"{group.degree} ranks), got {shape}")
            if t.device != self.device:
                raise PlanError(f"{where}: shard {name} is on {t.device} but the model is on {self.device}; "
                                f"give the loader device={self.device}")
        cu = shard.cu_seqlens
        bounds = cu.numel() if ring else len(group.seq_ids) + 1   # a ring shard bounds its zigzag chunks
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != bounds or cu.device != self.device:
            raise PlanError(f"{where}: cu_seqlens must be int32 [{bounds}] on {self.device}, got "
                            f"{cu.dtype} {tuple(cu.shape)} on {cu.device}")
        # host bounds: sdpa reads no device, and the rule sees the length mix (a ring shard: its zigzag chunks')
        if ring:
            local = shard.ring.tensors.host_local
            host = local[shard.ring.comm.index] if shard.ring.comm.index < len(local) else None
        else:
            host = tuple(accumulate((int(lengths[s]) for s in group.seq_ids), initial=0))
        ctx = AttentionContext(cu_seqlens=cu, max_seqlen=int(shard.max_seqlen), group=handle, backend=self.backend,
                               ring=shard.ring if ring else None, bounds=host)
        return _Work(shard.input_ids, shard.position_ids, shard.labels, ctx, int(shard.real_tokens), group)

    def _pack(self, tokens: Sequence[torch.Tensor], targets: Sequence[torch.Tensor | None] | None,
              group: Group | None) -> _Work | None:
        if group is None:
            return None
        shard, ctx = group_inputs(group, [tokens[s] for s in group.seq_ids], self.pool.rank, self.device,
                                  pool=self.pool, backend=self.backend,
                                  targets=None if targets is None else [targets[s] for s in group.seq_ids])
        return _Work(shard.input_ids, shard.position_ids, shard.labels, ctx, shard.real_tokens, group)

    def _agree(self, error: BaseException | None) -> None:
        if self.channel is not None and self.channel.record is not None:
            raise RankFailure(self.channel.record)   # a previous step failed somewhere: the world is gone
        agree(error)

    # --- the step (collectives) -----------------------------------------------------------------
    def _idle(self) -> _Work:
        """A one-token, label-free shard at degree 1: runs every layer (so every FSDP collective) for nothing."""
        if self._dummy is None:
            one = lambda value: torch.full((1,), value, dtype=torch.long, device=self.device)   # noqa: E731
            self._dummy = _Work(one(PAD_TOKEN), one(0), one(IGNORE_INDEX),
                                AttentionContext.single(1, self.backend, device=self.device), 0, None)
        return self._dummy

    def _run(self, work: list[_Work | None], denominator: int) -> StepResult:
        start = time.perf_counter()
        self.probe.checked()
        if denominator == 0:   # every rank knows it (the same batch, or the loader's agreed count)
            log.warning("step %d: the global batch has no supervised target (every label -100 or masked): "
                        "a zero-loss step, zero gradients", self.steps)
        try:
            (loss, aux), processed, seq_ids, degrees = self._forward_backward(work, denominator)
            self.optimizer.step()
        except Exception as exc:
            if self.channel is None:
                raise
            recorded = self.channel.failure(wait=1.0) or self.channel.post(exc, f"in step {self.steps}")
            raise RankFailure(recorded) from exc
        self.steps += 1
        result = StepResult(loss=loss, loss_tokens=denominator, tokens_processed=processed, seq_ids=tuple(seq_ids),
                            degrees=tuple(degrees), seconds=time.perf_counter() - start, aux_loss=aux)
        self.probe.step_end(result)
        return result

    def _forward_backward(self, work: list[_Work | None], denominator: int):
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.zeros(2, dtype=torch.float64, device=self.device)   # [total loss, its auxiliary part]
        processed, seq_ids, degrees = 0, [], []
        autocast = nullcontext() if self.autocast is None else torch.autocast(self.device.type, dtype=self.autocast)
        coupled = BatchCoupled(self.model, self.pool, self._idle) if batch_coupled(self.model) else None
        if coupled is not None and len(work) > 1:   # the totals must be known before the first backward
            with autocast:
                coupled.prepass(work)
        for m, w in enumerate(work):
            self.probe.micro_batch_begin(m, None if w is None else w.group, 0 if w is None else w.real_tokens)
            if w is None:
                d = self._idle()
                with autocast:
                    if coupled is None:
                        loss = self.model.shard_loss(d.input_ids, d.position_ids, d.labels, d.ctx) * 0.0
                    else:
                        loss = coupled.losses(d, lambda lm: step_loss(lm, denominator), idle=True)[0] * 0.0
                degrees.append(None)
            else:
                with autocast:   # forward only (autocast's rule); backward runs in the dtypes forward chose
                    if coupled is None:
                        loss = step_loss(self.model.shard_loss(w.input_ids, w.position_ids, w.labels, w.ctx),
                                         denominator)
                    else:   # the LM loss as above plus the auxiliary term, kept apart for the report
                        loss, aux = coupled.losses(w, lambda lm: step_loss(lm, denominator), idle=False)
                        local[1] += aux.detach().to(torch.float64)
                local[0] += loss.detach().to(torch.float64)
                processed += w.real_tokens
                seq_ids.extend(w.group.seq_ids)
                degrees.append(w.group.degree)
            self.probe.forward_end(m)
            loss.backward()   # collectives: FSDP per layer over the world, all-to-all backward in the group
            self.probe.micro_batch_end(m)
        if self.pool.world_size > 1:
            if not self.sharded:
                _allreduce_grads(self.model)
            dist.all_reduce(local)
        return (float(local[0]), float(local[1])), processed, seq_ids, degrees


def _rows(batch: Sequence[Any], vocab_size: int | None
          ) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None, int]:
    """The batch's token tensors, their targets (None: plain next-token) and its supervised-target count."""
    if isinstance(batch, (str, bytes, Mapping)) or not isinstance(batch, Sequence):
        raise PlanError(f"the batch must be a sequence of rows (token tensors or mappings), got {type(batch).__name__}")
    tokens, targets, supervised = [], [], 0
    for i, item in enumerate(batch):
        seq = item.get("input_ids") if isinstance(item, Mapping) else item
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.numel() == 0:
            shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else type(seq).__name__
            raise PlanError(f"batch[{i}] must be a non-empty 1-D tensor of token ids (or a mapping with one as "
                            f"input_ids), got {shape}")
        ids = integers(seq, f"batch[{i}] (token ids)", PlanError)   # floats and booleans would be cast silently
        out_of_vocabulary(ids, vocab_size, f"batch[{i}]", PlanError)
        target, count = read_targets(item if isinstance(item, Mapping) else {}, ids, f"batch[{i}]", vocab_size)
        tokens.append(seq)
        targets.append(target)
        supervised += count
    if not tokens:
        raise PlanError("the batch is empty")
    return tokens, (None if all(t is None for t in targets) else targets), supervised


def _vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary where it says (TinyLM's spec, a Hugging Face config): labels are checked against it."""
    spec = getattr(model, "cfg", None)
    if getattr(spec, "vocab", None) is not None:
        return int(spec.vocab)
    config = getattr(getattr(model, "model", None), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    vocab = getattr(config, "vocab_size", None)
    return int(vocab) if vocab is not None else None


BUCKET_BYTES = 25 * 2**20   # gradients summed per all-reduce: a few collectives per step, a bounded flat copy


def _allreduce_grads(model: nn.Module) -> None:
    """Sum gradients of an unsharded model over the world in buckets of at most ``BUCKET_BYTES`` (one
    collective per bucket, as DDP does, instead of one per parameter: on gloo the per-call latency
    dominated the step tail), all buckets in flight at once; a parameter larger than a bucket goes alone,
    without a copy."""
    grads: list[torch.Tensor] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:   # unused this step on this rank: still joins, with zeros
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if (not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].dtype != g.dtype
                or buckets[-1][0].device != g.device):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    pending = []
    for bucket in buckets:
        flat = bucket[0] if len(bucket) == 1 else torch.cat([g.reshape(-1) for g in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
    for bucket, flat, handle in pending:
        handle.wait()
        if len(bucket) > 1:
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(part.view_as(g))
