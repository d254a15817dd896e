"""``flexsp``: heterogeneous SP groups found by the solver's search (the paper's method)."""
from __future__ import annotations

from flexsp.plan.strategies.registry import Strategy, register_strategy
from solver.search import search_plan

STRATEGY = register_strategy(Strategy(
    "flexsp", lambda r: search_plan(r.lengths, r.costs, r.num_gpus, r.options, fallbacks=r.candidates,
                                    deadline=r.deadline),
    "heterogeneous SP groups, searched; also considers the batchada and dynamic-cp plans",
    candidates=("batchada", "dynamic-cp")))
