"""Execute FlexSP plans: SP group pool, Ulysses attention, packing, FSDP2 sharding and the planned step.

Imports torch at module level, as do the loader (``flexsp.data``), ``flexsp.hf``, the torch parts of
``flexsp.profile``, ``flexsp.replay`` and ``flexsp.checkpoint``; the planner (``import flexsp``) never
does. See ``README.md`` beside this file and docs/design.md ("The runtime's data flow").
"""
from flexsp.runtime.config import TrainConfig
from flexsp.runtime.failures import FailureChannel, RankFailure, agree
from flexsp.runtime.fsdp import runtime_sharding, shard_model
from flexsp.runtime.kernels import attend, attend_lse, flash_available, merge_partials
from flexsp.runtime.models.loss import linear_cross_entropy
from flexsp.runtime.models.protocol import SPModel
from flexsp.runtime.models.tiny import TinyLM
from flexsp.runtime.pool import GroupPool, PoolStats, init_distributed
from flexsp.runtime.shard import PackedGroup, loss_tokens, pack
from flexsp.runtime.sp.attention import sp_attention
from flexsp.runtime.sp.context import (
           IGNORE_INDEX,
           AttentionContext,
           Shard,
           ShardingError,
)
from flexsp.runtime.sp.ring import RingContext, ring_attention
from flexsp.runtime.sp.ulysses import ulysses_attention
from flexsp.runtime.sp.ulysses_comm import all_to_all, head_to_seq, seq_to_head
from flexsp.runtime.step import StepExecutor, StepResult, validate_step

__all__ = ["TrainConfig", "GroupPool", "PoolStats", "init_distributed", "StepExecutor", "StepResult", "validate_step",
           "shard_model", "runtime_sharding", "FailureChannel", "RankFailure", "agree", "SPModel",
           "linear_cross_entropy", "AttentionContext", "sp_attention", "ulysses_attention", "ShardingError", "attend",
           "attend_lse", "merge_partials", "ring_attention", "RingContext", "flash_available", "all_to_all",
           "seq_to_head", "head_to_seq", "pack", "PackedGroup", "Shard", "loss_tokens", "IGNORE_INDEX",
           "TinyLM"]
