"""``PlanConfig``: every planning setting in one frozen object, each default written once.

The CLI, the loader, ``simulate``, the examples and ``plan_batch`` all build or receive one and pass it
down whole. ``PlanConfig`` checks the type and range of every field when it is built (a ``PlanError``
naming the field: ``degrees="18"`` is not (1, 8), ``2.5`` is not 2, ``nan`` is not a time limit, ``"fast"``
is not a registered strategy). ``strategy="static:8"`` means ``strategy="static", sp_degree=8`` and
``"flexsp[1,8,64]"`` sets ``degrees``: the syntax of ``flexsp simulate --strategies`` and ``flexsp plan
--strategy`` too. ``checked(cost, cluster)`` adds the checks that need the cost model and cluster
(degrees the cluster has, ``sp_degree`` only for a strategy that takes one).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexsp.errors import CostModelError, PlanError
from flexsp.inputs import integer, number
from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel
from flexsp.plan.memory import DEFAULT as DEFAULT_SHARDING
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import check_recompute
from flexsp.plan.strategies import get_strategy, parse_strategy, strategies
from solver.search import SearchOptions


@dataclass(frozen=True)
class PlanConfig:
    """How to plan a batch. ``time_limit``: wall-clock seconds every strategy may search (the best plan
    by then is returned); ``degrees``: the only SP degrees groups may have (e.g. ``(1, 8, 64)``: fewer
    communicators per rank; ``(1, 2, 3, 6, 12)``: any degree with a tile, inside a node or whole nodes;
    ``"any"``: every degree with a tile that the cost model can cost; default None: the cluster's powers
    of two, ``Cluster.degrees``); ``max_degree``: no group above it; ``ulysses_only``: keep every group within
    the model's head limit (no ring axis); ``sp_degree``: the degree of a strategy that takes one
    (``static``); ``sharding``/``recompute``: the memory setting cost models are built for
    (``flexsp.plan.memory``); ``validate``: check every plan with ``Plan.validate``."""

    strategy: str = "flexsp"
    time_limit: float = 2.0
    num_buckets: int = SearchOptions.num_buckets
    sp_degree: int | None = None
    max_degree: int | None = None
    degrees: tuple[int, ...] | str | None = None     # None: powers of two; "any"; or a set of degrees
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
        self._strategy(set_)
        set_("time_limit", number(self.time_limit, "time_limit (seconds)", PlanError, positive=True))
        set_("num_buckets", integer(self.num_buckets, "num_buckets", PlanError, maximum=2**20))
        if self.max_degree is not None:
            set_("max_degree", integer(self.max_degree, "max_degree (the largest SP degree a group may have; or None)",
                                       PlanError))
        if self.sp_degree is not None:
            set_("sp_degree", integer(self.sp_degree, "sp_degree", PlanError, maximum=2**40))
        if self.degrees is not None:
            set_("degrees", _degrees(self.degrees))
        try:
            check_sharding(self.sharding)
        except Exception as exc:
            raise PlanError(str(exc)) from None

    def _strategy(self, set_) -> None:
        """``strategy`` in the one strategy syntax (``parse_strategy``): ``static:8`` sets ``sp_degree``,
        ``flexsp[1,8,64]`` sets ``degrees`` (a clash with the field given too is refused); the name must be
        registered, so ``strategy="fast"`` fails here, before a model or a loader is built."""
        if isinstance(self.strategy, str) and (":" in self.strategy or "[" in self.strategy):
            spec = parse_strategy(self.strategy)
            for name, value in (("sp_degree", spec.sp_degree), ("degrees", spec.degrees)):
                given = getattr(self, name)
                if value is not None and given is not None and given != value:
                    raise PlanError(f"strategy={self.strategy!r} sets {name}={value!r} but {name}={given!r} is given "
                                    f"too; give it once")
                if value is not None:
                    set_(name, value)
            set_("strategy", spec.strategy)
        get_strategy(self.strategy)                 # PlanError naming the registered strategies (None too)

    def replace(self, **changes: Any) -> "PlanConfig":
        """A copy with ``changes`` (each checked as at construction)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise PlanError(f"unknown planning settings {unknown}; valid: "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    def checked(self, cost: CostModel, cluster: Cluster) -> "PlanConfig":
        """This config against ``cost`` and ``cluster``: the strategy exists, ``sp_degree`` only where the
        strategy takes one, ``degrees`` have tiles on the cluster (``"any"`` resolved to a tuple: every degree
        with a tile the cost model can cost, within ``max_degree``); ``ulysses_only`` leaves only degrees that need no ring,
        and so does a cost model without a ring axis by default."""
        if not isinstance(cluster, Cluster):
            raise PlanError(f"cluster must be a flexsp.Cluster, got {type(cluster).__name__}")
        if not isinstance(cost, CostModel):
            raise PlanError(f"cost must be a flexsp.CostModel, got {type(cost).__name__}")
        spec = get_strategy(self.strategy)          # PlanError naming the registered strategies (None too)
        if self.sp_degree is not None and not spec.accepts_sp_degree:
            takers = [s.name for s in strategies() if s.accepts_sp_degree]
            raise PlanError(f"sp_degree={self.sp_degree!r} is used only by strategy={' or '.join(map(repr, takers))} "
                            f"(got {self.strategy!r}); to restrict other strategies pass degrees=(...) or max_degree")
        max_degree = self.max_degree
        # ``ulysses_only``: the degrees whose Ulysses part is the whole group (they divide the heads), not a cap:
        # with 24 heads, 12 and 24 are pure Ulysses while 16 is not
        ring = (lambda d: cost.split(d)[1] > 1) if self.ulysses_only else (lambda d: False)
        degrees = self.degrees
        if degrees == "any":
            degrees = tuple(d for d in cluster.all_degrees if (max_degree is None or d <= max_degree)
                            and (d == 1 or cost.costs_degree(d)) and not ring(d))
        elif degrees is not None:
            degrees = cluster.check_degrees(degrees)      # PlanError naming each degree without a tile
            rings = [d for d in degrees if ring(d)]
            if rings:
                raise PlanError(f"ulysses_only=True but degrees {rings} need a ring axis ({cost.heads} heads: Ulysses "
                                f"takes gcd(degree, heads)); drop them or allow rings")
        elif any(cost.split(d)[1] > 1 for d in cluster.degrees) and (self.ulysses_only or cost.ring_bandwidth is None):
            # the cluster's default degrees, less rings: asked for, or the model has no ring axis (its linear-attention
            # layers cannot run on one: flexsp.plan.analytic.model_axes)
            degrees = tuple(d for d in cluster.degrees if cost.split(d)[1] == 1)
        if self.sp_degree is not None and ring(self.sp_degree):
            raise PlanError(f"ulysses_only=True but sp_degree={self.sp_degree} needs a ring axis ({cost.heads} heads: "
                            f"Ulysses takes gcd(degree, heads))")
        if self.sp_degree is not None:
            cluster.check_degrees([self.sp_degree])
            default = cluster.degrees if degrees is None else degrees
            if self.degrees is None and self.sp_degree not in default:
                degrees = tuple(sorted({*default, self.sp_degree}))   # static at 6 (or 24 of 24 heads): usable
        return dataclasses.replace(self, max_degree=max_degree, degrees=degrees)


def _degrees(degrees: Any) -> tuple[int, ...] | str:
    """``degrees``: "any", or a collection of SP degrees, e.g. (1, 8, 64) or (1, 2, 3, 6, 12) (which
    have tiles on the cluster is checked by ``checked``)."""
    valid = "\"any\" or a collection of SP degrees, e.g. degrees=(1, 8, 64) or (1, 2, 3, 6, 12)"
    if isinstance(degrees, str) and degrees.strip().lower() == "any":
        return "any"
    if isinstance(degrees, (str, bytes, Mapping)) or not isinstance(degrees, Iterable):
        raise PlanError(f"degrees must be {valid}; got {degrees!r}")
    out = sorted({integer(d, "each of degrees", PlanError, maximum=2**40) for d in degrees})
    if not out:
        raise PlanError(f"degrees is empty; it must be {valid}")
    return tuple(out)
