"""The sequence-parallel axes, one module each, beside their communication.

| module | job |
|---|---|
| ``tokens`` | ``Shard`` (one rank's tokens), pad/ignore ids: imported by the layouts and the context |
| ``context`` | ``AttentionContext`` (group, packed layout, backend) and its ring half ``RingContext``, ``check_heads`` |
| ``ulysses_comm`` | the autograd all-to-all and the ``Exchange`` seam replay substitutes |
| ``ulysses`` | Ulysses attention: token shard -> head shard, local kernel, back |
| ``ring_comm`` | which ranks form rings; one non-blocking K/V hop |
| ``zigzag`` | the ring axis's token layout (causal work balanced over the ring) |
| ``ring`` | Ulysses x ring attention (log-sum-exp merge, K/V passed while computing) |
| ``attention`` | ``sp_attention``: the one place that picks the axis for a group |
"""
from flexsp.runtime.sp.attention import sp_attention
from flexsp.runtime.sp.context import IGNORE_INDEX, PAD_TOKEN, AttentionContext, ShardingError, check_heads

__all__ = ["sp_attention", "AttentionContext", "ShardingError", "check_heads", "IGNORE_INDEX", "PAD_TOKEN"]
