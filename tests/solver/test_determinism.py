"""Plans depend on the inputs, not on the machine's speed: search budgets are counted in work and the
wall-clock ``time_limit`` is only a safety net, which says when it fires.

A loaded machine is modelled by a clock that runs 40x fast (every step "takes" 40x longer), which is
what a binding time budget would see on a machine 40x slower: the plan must not change."""
import time
import warnings

import numpy as np
import pytest

import flexsp
from flexsp.plan.planner import TimeLimitWarning


@pytest.fixture(scope="module")
def preset():
    return flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64), flexsp.Cluster(64, 8)


def lengths(seed: int, size: int = 512) -> np.ndarray:
    wiki = flexsp.plan.lengths.get_distribution("wikipedia").lengths
    pool = wiki[wiki <= 384 * 1024]
    return flexsp.plan.lengths.preprocess(pool[np.random.default_rng(seed).integers(0, pool.size, size=size)],
                                          384 * 1024, 64)[0]


def layout(plan):
    return [[(g.ranks, g.seq_ids, g.ring) for g in mb.groups] for mb in plan.micro_batches]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_plan_on_a_slow_clock(preset, monkeypatch, seed):
    cost, cluster = preset
    batch = lengths(seed)
    idle = flexsp.plan_batch(batch, cost, cluster, time_limit=10_000)
    real, origin = time.perf_counter, time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: origin + 40 * (real() - origin))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeLimitWarning)          # the safety net must not fire here
        loaded = flexsp.plan_batch(batch, cost, cluster, time_limit=10_000)
    assert layout(loaded) == layout(idle) and loaded.predicted_time == idle.predicted_time
    assert "time_limit_hit" not in loaded.meta


def test_the_safety_net_says_when_it_fires(preset):
    cost, cluster = preset
    batch = lengths(2)
    with pytest.warns(TimeLimitWarning, match="time limit of 1e-06 s passed"):
        plan = flexsp.plan_batch(batch, cost, cluster, time_limit=1e-6)
    assert plan.meta["time_limit_hit"] is True
    plan.validate(batch, cost, cluster)                   # still a valid plan, the best found by then
