"""Execute FlexSP plans: SP group pool, Ulysses attention, packing and the planned training step.

The only part of flexsp that imports torch at module level. See ``README.md`` beside this file.
"""
from .attention import attend, attend_lse, flash_available, merge_partials
from .comm import all_to_all, head_to_seq, seq_to_head
from .executor import StepExecutor, StepResult, validate_step
from .groups import GroupPool, PoolStats
from .model import ModelConfig, TinyLM
from .packing import IGNORE_INDEX, PackedGroup, Shard, loss_tokens, pack
from .ring import RingContext, ring_attention
from .ulysses import AttentionContext, ShardingError, ulysses_attention

__all__ = ["GroupPool", "PoolStats", "StepExecutor", "StepResult", "validate_step", "AttentionContext",
           "ulysses_attention", "ShardingError", "attend", "attend_lse", "merge_partials", "ring_attention",
           "RingContext", "flash_available", "all_to_all", "seq_to_head",
           "head_to_seq", "pack", "PackedGroup", "Shard", "loss_tokens", "IGNORE_INDEX", "ModelConfig", "TinyLM"]
