"""``dynamic-cp``: Megatron-LM's dynamic context-parallel rule (group size from each sequence's length)."""
from __future__ import annotations

from flexsp.plan.strategies.registry import Strategy, register_strategy
from solver.dynamic_cp import dynamic_cp

STRATEGY = register_strategy(Strategy(
    "dynamic-cp", lambda r: dynamic_cp(r.lengths, r.costs, r.num_gpus, deadline=r.deadline),
    "Megatron-LM's dynamic context-parallel rule (group size from each sequence's length)"))
