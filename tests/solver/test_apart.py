"""Long sequences planned apart (``solver.search.apart_candidate``) when a big batch holds a sequence needing
more than ``APART_TRIGGER_DEGREE`` GPUs: the rule's sizes and degrees are shrunk here so small batches
exercise every branch; plans are checked independently and compared with the two plans the rule chooses
between."""
import numpy as np
import pytest

import solver.search as search
from solver.types import DegreeCosts

# degrees 1..16 on 16 GPUs, 100 tokens per GPU
COSTS = DegreeCosts(degrees=(1, 2, 4, 8, 16), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7, 6.25e-8),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4, 1.2e-4), capacity=(100.0, 200.0, 400.0, 800.0, 1600.0), beta1=0.05)


def validate_schedule(schedule, lengths: np.ndarray, costs: DegreeCosts, num_gpus: int) -> None:
    """Every sequence once, each micro-batch within the GPUs, each group within its memory."""
    seen = np.concatenate([g.seq_ids for mb in schedule.micro_batches for g in mb])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for mb in schedule.micro_batches:
        assert sum(g.degree for g in mb) <= num_gpus
        for g in mb:
            assert lengths[g.seq_ids].sum() <= costs.capacity[costs.index(g.degree)]


def batch(seed: int, longs: int, low: int = 900, size: int = 80) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 90, size=size)
    lengths[:longs] = rng.integers(low, 1600, size=longs)
    return lengths


@pytest.fixture
def small_rule(monkeypatch):
    """Apart when a sequence needs more than 8 GPUs (800 tokens); 'long' is more than 4 GPUs (400)."""
    monkeypatch.setattr(search, "APART_DEGREE", 4)
    monkeypatch.setattr(search, "APART_TRIGGER_DEGREE", 8)
    monkeypatch.setattr(search, "APART_SEQUENCES", (20, 50))


def test_needs_apart_reads_the_longest_against_the_trigger_degree(small_rule):
    assert search.needs_apart(batch(0, 3), COSTS)                        # 900+ tokens: more than 8 GPUs
    assert not search.needs_apart(batch(0, 3, low=500, size=80).clip(max=800), COSTS)   # long, under the trigger
    assert not search.needs_apart(batch(0, 0), COSTS)
    assert not search.needs_apart(np.full(5, 1000), COSTS)               # all long: nothing to plan apart


@pytest.mark.parametrize("seed", range(3))
def test_above_the_upper_size_the_batch_is_planned_apart_only(small_rule, seed):
    lengths = batch(seed, 6)
    plan = search.search_plan(lengths, COSTS, 16)
    validate_schedule(plan, lengths, COSTS, 16)
    apart = search.apart_candidate(lengths, COSTS, 16, search.SearchOptions(), None)
    joint = search.search_plan(lengths, COSTS, 16, apart=False)
    assert plan.time(lengths, COSTS) == pytest.approx(apart.time(lengths, COSTS))
    assert apart.time(lengths, COSTS) != joint.time(lengths, COSTS)      # the two differ: the test tells them apart


@pytest.mark.parametrize("seed", range(3))
def test_long_sequences_under_the_trigger_keep_the_joint_search(small_rule, seed):
    lengths = batch(seed, 6, low=500).clip(max=800)
    plan = search.search_plan(lengths, COSTS, 16)
    joint = search.search_plan(lengths, COSTS, 16, apart=False)
    assert plan.time(lengths, COSTS) == joint.time(lengths, COSTS)


@pytest.mark.parametrize("seed", range(3))
def test_between_the_sizes_the_faster_of_both_plans_wins(small_rule, monkeypatch, seed):
    monkeypatch.setattr(search, "APART_SEQUENCES", (20, 500))
    lengths = batch(seed, 6)
    plan = search.search_plan(lengths, COSTS, 16)
    validate_schedule(plan, lengths, COSTS, 16)
    joint = search.search_plan(lengths, COSTS, 16, apart=False)
    apart = search.apart_candidate(lengths, COSTS, 16, search.SearchOptions(), None)
    assert plan.time(lengths, COSTS) <= min(joint.time(lengths, COSTS), apart.time(lengths, COSTS)) * (1 + 1e-12)
