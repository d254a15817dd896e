"""``batchada``: the best single SP degree for each batch (the paper's BatchAda baseline)."""
from __future__ import annotations

from flexsp.plan.strategies.registry import Strategy, register_strategy
from solver.baselines import batchada

STRATEGY = register_strategy(Strategy(
    "batchada", lambda r: batchada(r.lengths, r.costs, r.num_gpus, r.deadline),
    "the best single SP degree for this batch (BatchAda)"))
