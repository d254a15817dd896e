"""``PlanConfig``: every planning setting in one frozen object, each default written once.

The CLI, the loader, ``simulate``, the examples and ``plan_batch`` all build or receive one and pass it
down whole. ``PlanConfig`` checks the type and range of every field when it is built (a ``PlanError``
naming the field: ``degrees="18"`` is not (1, 8), ``2.5`` is not 2, ``nan`` is not a time limit);
``checked(cost, cluster)`` adds the checks that need the cost model and cluster (strategy name,
degrees the cluster has, ``sp_degree`` only for a strategy that takes one).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexsp.errors import CostModelError, PlanError
from flexsp.inputs import integer, number, power_of_two
from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel
from flexsp.plan.memory import DEFAULT as DEFAULT_SHARDING
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import check_recompute
from flexsp.plan.strategies import get_strategy, strategies
from solver.search import SearchOptions


@dataclass(frozen=True)
class PlanConfig:
    """How to plan a batch. ``time_limit``: wall-clock seconds every strategy may search (the best plan
    by then is returned); ``degrees``: the only SP degrees groups may have (e.g. ``(1, 8, 64)``: fewer
    communicators per rank); ``max_degree``: no group above it; ``ulysses_only``: keep every group within
    the model's head limit (no ring axis); ``sp_degree``: the degree of a strategy that takes one
    (``static``); ``sharding``/``recompute``: the memory setting cost models are built for
    (``flexsp.plan.memory``); ``validate``: check every plan with ``Plan.validate``."""

    strategy: str = "flexsp"
    time_limit: float = 2.0
    num_buckets: int = SearchOptions.num_buckets
    sp_degree: int | None = None
    max_degree: int | None = None
    degrees: tuple[int, ...] | None = None
    ulysses_only: bool = False
    sharding: str = DEFAULT_SHARDING
    recompute: str = "none"                   # "none", "selective" (attention), "full"; a bool means full/none
    validate: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "recompute", check_recompute(self.recompute))
        except CostModelError as exc:
            raise PlanError(str(exc)) from None
        for name in ("ulysses_only", "validate"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise PlanError(f"{name} must be True or False, got {getattr(self, name)!r}")
        set_ = lambda name, value: object.__setattr__(self, name, value)   # noqa: E731 (frozen)
        set_("time_limit", number(self.time_limit, "time_limit (seconds)", PlanError, positive=True))
        set_("num_buckets", integer(self.num_buckets, "num_buckets", PlanError, maximum=2**20))
        if self.max_degree is not None:
            set_("max_degree", integer(self.max_degree, "max_degree (the largest SP degree a group may have; or None)",
                                       PlanError))
        if self.sp_degree is not None:
            set_("sp_degree", power_of_two(self.sp_degree, "sp_degree", PlanError))
        if self.degrees is not None:
            set_("degrees", _degrees(self.degrees))
        try:
            check_sharding(self.sharding)
        except Exception as exc:
            raise PlanError(str(exc)) from None

    def replace(self, **changes: Any) -> "PlanConfig":
        """A copy with ``changes`` (each checked as at construction)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise PlanError(f"unknown planning settings {unknown}; valid: "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    def checked(self, cost: CostModel, cluster: Cluster) -> "PlanConfig":
        """This config against ``cost`` and ``cluster``: the strategy exists, ``sp_degree`` only where the
        strategy takes one, ``degrees`` are the cluster's; ``ulysses_only`` folded into ``max_degree``."""
        if not isinstance(cluster, Cluster):
            raise PlanError(f"cluster must be a flexsp.Cluster, got {type(cluster).__name__}")
        if not isinstance(cost, CostModel):
            raise PlanError(f"cost must be a flexsp.CostModel, got {type(cost).__name__}")
        spec = get_strategy(self.strategy)          # PlanError naming the registered strategies (None too)
        if self.sp_degree is not None and not spec.accepts_sp_degree:
            takers = [s.name for s in strategies() if s.accepts_sp_degree]
            raise PlanError(f"sp_degree={self.sp_degree!r} is used only by strategy={' or '.join(map(repr, takers))} "
                            f"(got {self.strategy!r}); to restrict other strategies pass degrees=(...) or max_degree")
        if self.degrees is not None:
            bad = [d for d in self.degrees if d not in cluster.degrees]
            if bad:
                raise PlanError(f"degrees {bad} are not usable on {cluster.num_gpus} GPUs; choose powers of two from "
                                f"{list(cluster.degrees)}")
        max_degree = self.max_degree
        if self.ulysses_only and cost.ulysses_limit is not None:
            max_degree = cost.ulysses_limit if max_degree is None else min(max_degree, cost.ulysses_limit)
        return dataclasses.replace(self, max_degree=max_degree)


def _degrees(degrees: Any) -> tuple[int, ...]:
    """``degrees``: a collection of power-of-two SP degrees, e.g. (1, 8, 64)."""
    valid = "a collection of power-of-two SP degrees, e.g. degrees=(1, 8, 64)"
    if isinstance(degrees, (str, bytes, Mapping)) or not isinstance(degrees, Iterable):
        raise PlanError(f"degrees must be {valid}; got {degrees!r}")
    out = sorted({power_of_two(d, "each of degrees", PlanError) for d in degrees})
    if not out:
        raise PlanError(f"degrees is empty; it must be {valid}")
    return tuple(out)
