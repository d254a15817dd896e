"""Every strategy returns within ``time_limit`` plus a small constant, on batches that need one
micro-batch or thousands, and the micro-batch count is searched, not stepped.

Margins are generous (CI machines are shared) but far below what ignoring the limit costs: before
the count search and the deadlines, the first batch took 24-28 s (flexsp, greedy) and the second
42 s (batchada) at a 0.5 s limit."""
import time

import numpy as np
import pytest

import flexsp
from flexsp.plan.strategies import names as strategy_names

STRATEGIES = strategy_names()
from flexsp.plan.planner import TimeLimitWarning
from solver.counting import search_count

LIMIT = 0.5
MARGIN = 8.0     # seconds past the limit allowed here (loaded CI); the README states the measured constant


@pytest.fixture(scope="module")
def preset():
    return flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64), flexsp.Cluster(64, 8)


def timed(lengths, cost, cluster, strategy):
    started = time.perf_counter()
    plan = flexsp.plan_batch(lengths, cost, cluster, strategy, time_limit=LIMIT)
    return plan, time.perf_counter() - started


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_thousands_of_micro_batches_within_the_limit(preset, strategy):
    cost, cluster = preset
    lengths = np.random.default_rng(0).integers(50_000, 390_000, size=3000)   # ~1,700-2,200 micro-batches
    plan, wall = timed(lengths, cost, cluster, strategy)
    assert len(plan.micro_batches) > 1000
    assert wall < LIMIT + MARGIN, f"{strategy} took {wall:.1f} s at time_limit={LIMIT}"


@pytest.mark.parametrize("strategy", ["batchada", "static", "flexsp"])
def test_lengths_just_over_half_a_gpu_within_the_limit(preset, strategy):
    cost, cluster = preset
    lengths = np.full(20_000, 3204)                      # two never share one GPU of the preset
    plan, wall = timed(lengths, cost, cluster, strategy)
    assert sum(len(g.seq_ids) for mb in plan.micro_batches for g in mb.groups) == 20_000
    assert wall < LIMIT + MARGIN, f"{strategy} took {wall:.1f} s at time_limit={LIMIT}"


def test_one_micro_batch_is_still_found(preset):
    cost, cluster = preset
    lengths = np.full(64, 2048)
    for strategy in STRATEGIES:
        assert len(flexsp.plan_batch(lengths, cost, cluster, strategy, time_limit=LIMIT).micro_batches) == 1


@pytest.mark.parametrize("answer", [1, 2, 7, 100, 1_999, 2_000])
def test_count_search_is_logarithmic_and_finds_the_least_fitting_count(answer):
    calls = []

    def fits(count):
        calls.append(count)
        return count >= answer

    assert search_count(fits, 1, 2_000) == answer
    assert len(calls) <= 2 * int(np.log2(answer)) + 3, calls


def test_count_search_returns_the_fallback_when_nothing_fits():
    assert search_count(lambda count: False, 3, 40) == 40


@pytest.mark.parametrize("seed", range(4))
def test_a_search_cut_short_is_no_worse_than_its_candidates(preset, seed):
    """Past the deadline (here: before the search starts) flexsp still returns a plan no slower than the
    batchada and dynamic-cp plans it considers: they are cheap, and a cut-short greedy split alone was
    3.2x slower than batchada's plan on an 8-sequence batch (a loaded machine, 0.2 s limit)."""
    cost, cluster = preset
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 60_000, size=8)
    with pytest.warns(TimeLimitWarning):
        cut = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=1e-9)
    for other in ("batchada", "dynamic-cp"):
        assert cut.predicted_time <= flexsp.plan_batch(lengths, cost, cluster, other).predicted_time * (1 + 1e-9)


def test_a_search_stopped_at_its_share_of_the_limit_still_refines_its_plan(monkeypatch):
    """The split search stops at ``SEARCH_SHARE`` of the time left so the plan is still refined on real
    lengths: with no share at all, the plan is the refined first split, no worse than the plan of a
    search whose deadline had passed before it began (nothing refined), flagged as cut short; the
    unlimited search is not flagged. ``plan_batch`` warns and records it."""
    import solver.search as search
    from solver.types import DegreeCosts
    costs = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                        lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)
    lengths = np.random.default_rng(3).integers(1, 700, size=300)
    full = search.search_plan(lengths, costs, 8)
    monkeypatch.setattr(search, "SEARCH_SHARE", 0.0)
    shared = search.search_plan(lengths, costs, 8, deadline=time.perf_counter() + 120)
    expired = search.search_plan(lengths, costs, 8, deadline=time.perf_counter() - 1)
    assert shared.cut_short and expired.cut_short and not full.cut_short
    assert sorted(np.concatenate([g.seq_ids for mb in shared.micro_batches for g in mb]).tolist()) == list(range(300))
    assert full.time(lengths, costs) <= shared.time(lengths, costs) <= expired.time(lengths, costs)
    assert shared.time(lengths, costs) < expired.time(lengths, costs)      # the refinement ran and helped

    cost = flexsp.CostModel(alpha1=1e-9, alpha2=1e-5, beta1=1e-3, comm_bytes_per_token=1e4,
                            alltoall_bandwidth={d: 1e10 for d in (2, 4, 8)}, token_capacity=4096)
    with pytest.warns(TimeLimitWarning, match="reached its share of the time limit"):
        plan = flexsp.plan_batch(np.random.default_rng(4).integers(100, 9000, size=200), cost, flexsp.Cluster(8),
                                 "flexsp", time_limit=120)
    assert plan.meta["time_limit_hit"]


def test_the_greedy_split_has_the_whole_limit_as_the_greedy_strategy_does(monkeypatch):
    """flexsp's first split is the greedy strategy's; under a tight limit it used to get only ``SEARCH_SHARE``
    of it, so its sweep could stop sooner than greedy's own and flexsp return a slower plan than greedy with
    the same limit (up to 16% on 2,000-4,000 Wikipedia sequences). The share applies to the search after it."""
    import solver.search as search
    from solver.types import DegreeCosts
    costs = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                        lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)
    seen = {}
    for name in ("first_split", "best_split"):
        real = getattr(search.BatchSearch, name)
        monkeypatch.setattr(search.BatchSearch, name,
                            lambda self, *a, _real=real, _name=name: seen.setdefault(_name, self.deadline) and _real(self, *a))
    deadline = time.perf_counter() + 100
    search.search_plan(np.random.default_rng(5).integers(1, 700, size=200), costs, 8, deadline=deadline)
    assert seen["first_split"] == deadline
    assert seen["best_split"] < deadline - 30            # 60% of what was left once the greedy split was found
