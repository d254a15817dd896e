"""``static``: one SP degree for every group of every step (DeepSpeed-Ulysses style)."""
from __future__ import annotations

from flexsp.errors import PlanError
from flexsp.plan.strategies.registry import PlanRequest, Strategy, register_strategy
from solver.baselines import single_degree
from solver.types import Schedule


def plan_static(r: PlanRequest) -> Schedule:
    degree = r.sp_degree if r.sp_degree is not None else r.costs.degrees[-1]
    if degree not in r.costs.degrees:
        raise PlanError(f"static sp_degree={degree} must be one of the usable degrees {list(r.costs.degrees)}")
    return single_degree(r.lengths, r.costs, r.num_gpus, degree, r.deadline)


STRATEGY = register_strategy(Strategy(
    "static", plan_static, "one SP degree for every group: sp_degree (static:D), default the largest usable",
    options=frozenset({"sp_degree"})))
