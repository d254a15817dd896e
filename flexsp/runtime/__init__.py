"""Execute FlexSP plans: SP group pool, Ulysses attention, packing, FSDP2 sharding and the planned step.

Imports torch at module level, as do the loader (``flexsp.data``), ``flexsp.hf``, the torch parts of
``flexsp.profile``, ``flexsp.replay`` and ``flexsp.checkpoint``; the planner (``import flexsp``) never
does. See ``README.md`` beside this file and docs/design.md ("The runtime's data flow").
"""
from .attention import attend, attend_lse, flash_available, merge_partials
from .comm import all_to_all, head_to_seq, seq_to_head
from .executor import StepExecutor, StepResult, validate_step
from .failures import FailureChannel, RankFailure, agree
from .fsdp import prepare_model, runtime_sharding
from .groups import GroupPool, PoolStats, init_distributed
from .model import ModelConfig, TinyLM
from .token_packing import IGNORE_INDEX, PackedGroup, Shard, loss_tokens, pack
from .protocol import SPModel, chunked_cross_entropy
from .ring import RingContext, ring_attention
from .ulysses import AttentionContext, ShardingError, ulysses_attention

__all__ = ["GroupPool", "PoolStats", "init_distributed", "StepExecutor", "StepResult", "validate_step",
           "prepare_model", "runtime_sharding", "FailureChannel", "RankFailure", "agree", "SPModel",
           "chunked_cross_entropy", "AttentionContext", "ulysses_attention", "ShardingError", "attend",
           "attend_lse", "merge_partials", "ring_attention", "RingContext", "flash_available", "all_to_all",
           "seq_to_head", "head_to_seq", "pack", "PackedGroup", "Shard", "loss_tokens", "IGNORE_INDEX",
           "ModelConfig", "TinyLM"]
