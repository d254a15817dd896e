"""``plan_batch``'s arguments, checked before any solving: each bad one is a ``PlanError`` (or the
``LengthsError`` of the batch) that names it and says what would be valid. Nothing is read loosely:
``degrees="18"`` is not (1, 8), ``2.5`` is not 2, ``nan`` is not a time limit."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import integer, number, power_of_two
from .cluster import Cluster
from .cost import CostModel
from .errors import PlanError
from .lengths import as_lengths
from .strategies import get_strategy, strategies



def __getattr__(name: str):
    if name == "STRATEGIES":   # the registered names, in registration order (flexsp.strategies)
        from .strategies import names
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class PlanArguments:
    lengths: np.ndarray                   # int64, validated
    strategy: str
    sp_degree: int | None
    time_limit: float
    num_buckets: int
    max_degree: int | None                # ulysses_only folded in
    degrees: tuple[int, ...] | None


def check_plan_arguments(lengths: Any, cost: Any, cluster: Any, strategy: Any, *, sp_degree: Any, time_limit: Any,
                         num_buckets: Any, max_degree: Any, degrees: Any, ulysses_only: Any,
                         validate: Any) -> PlanArguments:
    lengths = as_lengths(lengths)
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be a flexsp.Cluster, got {type(cluster).__name__}")
    if not isinstance(cost, CostModel):
        raise PlanError(f"cost must be a flexsp.CostModel, got {type(cost).__name__}")
    spec = get_strategy(strategy)          # PlanError naming the registered strategies
    for name, value in (("ulysses_only", ulysses_only), ("validate", validate)):
        if not isinstance(value, (bool, np.bool_)):
            raise PlanError(f"{name} must be True or False, got {value!r}")
    time_limit = number(time_limit, "time_limit (seconds)", PlanError, positive=True)
    num_buckets = integer(num_buckets, "num_buckets", PlanError, maximum=2**20)
    if max_degree is not None:
        max_degree = integer(max_degree, "max_degree (the largest SP degree a group may have; or None)", PlanError)
    if ulysses_only and cost.ulysses_limit is not None:
        max_degree = cost.ulysses_limit if max_degree is None else min(max_degree, cost.ulysses_limit)
    if degrees is not None:
        degrees = _degrees(degrees, cluster)
    if sp_degree is not None:
        if not spec.accepts_sp_degree:
            takers = [s.name for s in strategies() if s.accepts_sp_degree]
            raise PlanError(f"sp_degree={sp_degree!r} is used only by strategy={' or '.join(map(repr, takers))} "
                            f"(got {strategy!r}); "
                            f"to restrict other strategies pass degrees=(...) or max_degree")
        sp_degree = power_of_two(sp_degree, "sp_degree", PlanError)
    return PlanArguments(lengths, strategy, sp_degree, time_limit, num_buckets, max_degree, degrees)


def _degrees(degrees: Any, cluster: Cluster) -> tuple[int, ...]:
    """``degrees``: a collection of power-of-two SP degrees the cluster has, e.g. (1, 8, 64)."""
    valid = f"a collection of SP degrees from {list(cluster.degrees)}, e.g. degrees=(1, 8, 64)"
    if isinstance(degrees, (str, bytes, Mapping)) or not isinstance(degrees, Iterable):
        raise PlanError(f"degrees must be {valid}; got {degrees!r}")
    out = sorted({integer(d, "each of degrees", PlanError) for d in degrees})
    if not out:
        raise PlanError(f"degrees is empty; it must be {valid}")
    bad = [d for d in out if d not in cluster.degrees]
    if bad:
        raise PlanError(f"degrees {bad} are not usable on {cluster.num_gpus} GPUs; choose powers of two from "
                        f"{list(cluster.degrees)}")
    return tuple(out)
