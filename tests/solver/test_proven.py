"""The search stops at a plan it has proven optimal (``BatchSearch.batch_bound``). That is safe only if
the bound is never above the optimum, and worth it only if it stops the search; both are checked here,
against the subset DP's optimum on small batches and against the search run to the end."""
import numpy as np
import pytest

import solver.search
from solver.exact import exact_plan
from solver.search import BOUND_SLACK, BatchSearch, SearchOptions, search_plan
from solver.types import DegreeCosts

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)
# a ring axis at the high degrees: ``max(quad s^2, ring s + hops)`` makes short sequences slow there
RING = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                   lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.01,
                   ring=(0.0, 0.0, 4e-4, 3e-4), hops=(0.0, 0.0, 0.02, 0.04))


@pytest.mark.parametrize("costs", [COSTS, RING], ids=["ulysses", "ring"])
@pytest.mark.parametrize("seed", range(15))
def test_the_batch_bound_never_exceeds_the_optimum(costs, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(1, 9)))
    num_gpus = int(rng.choice([1, 2, 4, 8]))
    if lengths.max() > costs.capacity[costs.degrees.index(min(num_gpus, 8))]:
        lengths = np.minimum(lengths, int(costs.capacity[costs.degrees.index(min(num_gpus, 8))]))
    optimum = exact_plan(lengths, costs, num_gpus)
    assert optimum is not None
    assert BatchSearch(lengths, costs, num_gpus, SearchOptions()).batch_bound() <= optimum.time(lengths, costs) * (1 + 1e-12)


def test_the_bound_couples_the_longest_sequence_with_the_rest():
    """The longest sequence is fastest on all 8 GPUs, but while it runs there nothing else does, which the
    plain floor (the cheapest area spread, or the slowest sequence alone) ignores and the batch bound counts."""
    lengths = np.array([390] + [40] * 10)               # 790 tokens: one micro-batch of 800 may hold them
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    floor = max(search.real_area.sum() / 8, search.real_time.max()) + COSTS.beta1
    plan = search_plan(lengths, COSTS, 8, SearchOptions())
    assert floor * 1.04 < search.batch_bound() <= plan.time(lengths, COSTS) * (1 + BOUND_SLACK)


def test_the_search_stops_at_a_proven_optimum(monkeypatch):
    """A batch whose greedy split is already at the bound (its longest sequence alone on one GPU sets the
    pace, the rest fits beside it): no searched split is looked for, and the plan is at the bound."""
    lengths = np.array([200, 100, 50, 20, 20, 20, 20, 10, 5, 5, 5, 5])
    asked = []
    monkeypatch.setattr(BatchSearch, "best_split", lambda self, first: asked.append(1) or first)
    plan = search_plan(lengths, COSTS, 8, SearchOptions())
    assert not asked
    assert plan.time(lengths, COSTS) <= BatchSearch(lengths, COSTS, 8, SearchOptions()).batch_bound() * (1 + BOUND_SLACK)


@pytest.mark.parametrize("seed", range(12))
def test_stopping_early_never_costs_plan_time(seed, monkeypatch):
    rng = np.random.default_rng(50 + seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(9, 60)))
    if seed % 2:
        lengths[:3] = rng.integers(600, 800, size=3)   # a few long ones: the bound is often met
    costs = RING if seed % 3 == 0 else COSTS
    early = search_plan(lengths, costs, 8, SearchOptions()).time(lengths, costs)
    monkeypatch.setattr(BatchSearch, "batch_bound", lambda self: -np.inf)   # never proven: the whole search
    assert early <= search_plan(lengths, costs, 8, SearchOptions()).time(lengths, costs) * (1 + BOUND_SLACK)


def test_the_search_goes_on_when_nothing_is_proven(monkeypatch):
    """The check is not vacuous: a batch of similar lengths with many micro-batches is not at the bound."""
    lengths = np.random.default_rng(7).integers(300, 400, size=40)
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    greedy = search.refine_members(search.members(search.first_split()))
    assert greedy.time > search.batch_bound() * (1 + BOUND_SLACK)
    asked = []
    best_split = solver.search.BatchSearch.best_split
    monkeypatch.setattr(BatchSearch, "best_split", lambda self, first: asked.append(1) or best_split(self, first))
    search_plan(lengths, COSTS, 8, SearchOptions())
    assert asked
