"""``greedy``: FlexSP's one-pass heuristic, also the loader's fallback when a solve runs late."""
from __future__ import annotations

from flexsp.plan.strategies.registry import Strategy, register_strategy
from solver.search import greedy

STRATEGY = register_strategy(Strategy(
    "greedy", lambda r: greedy(r.lengths, r.costs, r.num_gpus, r.options, r.deadline),
    "FlexSP's one-pass heuristic (the sequence blaster's first split, packed)"))
