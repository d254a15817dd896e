"""``dynamic-cp``: Megatron-LM's dynamic context-parallel rule (group size from each sequence's length).

Its rule doubles group sizes along a ladder of degrees, as upstream does with powers of two, so with a
non-nesting degree set (``degrees="any"``) it plans on the set's nesting subset (``PlanRequest.fallback``)."""
from __future__ import annotations

from flexsp.plan.strategies.registry import PlanRequest, Strategy, register_strategy
from solver.types import DegreeCosts
from solver.dynamic_cp import dynamic_cp

def _ladder(r: PlanRequest) -> DegreeCosts:
    """The nesting subset when there is one that holds the longest sequence, else every usable degree."""
    if r.fallback is not None and r.fallback.capacity[-1] >= r.lengths.max():
        return r.fallback
    return r.costs


STRATEGY = register_strategy(Strategy(
    "dynamic-cp", lambda r: dynamic_cp(r.lengths, _ladder(r), r.num_gpus, deadline=r.deadline),
    "Megatron-LM's dynamic context-parallel rule (group size from each sequence's length)"))
