"""Long sequences planned apart (``solver.search.apart_candidate``) by the share of the batch's work they
carry: the rule's sizes are shrunk here so small batches exercise every branch; plans are checked by the
independent validator and compared with the two plans the rule chooses between."""
import numpy as np
import pytest

import solver.search as search
from solver.types import DegreeCosts

# degrees 1..16 on 16 GPUs; APART_DEGREE 8 -> "long" means more than 800 tokens
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


def batch(seed: int, longs: int, size: int = 80) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 90, size=size)
    lengths[:longs] = rng.integers(900, 1600, size=longs)
    return lengths


def test_long_share_counts_cheapest_area_of_the_long_ones():
    lengths = batch(0, 4)
    area = (COSTS.times(lengths) * np.asarray(COSTS.degrees)[None, :]).min(axis=1)
    assert search.long_share(lengths, COSTS) == pytest.approx(area[:4].sum() / area.sum())
    assert search.long_share(batch(0, 0), COSTS) == 0.0                   # none long
    assert search.long_share(np.full(5, 1000), COSTS) == 0.0              # all long: nothing to plan apart


@pytest.fixture
def small_rule(monkeypatch):
    monkeypatch.setattr(search, "APART_SEQUENCES", (20, 50))


@pytest.mark.parametrize("seed", range(3))
def test_above_the_upper_size_a_long_heavy_batch_is_planned_apart_only(small_rule, seed):
    lengths = batch(seed, 12)
    assert search.long_share(lengths, COSTS) >= search.APART_SHARE
    plan = search.search_plan(lengths, COSTS, 16)
    validate_schedule(plan, lengths, COSTS, 16)
    apart = search.apart_candidate(lengths, COSTS, 16, search.SearchOptions(), None)
    assert plan.time(lengths, COSTS) == pytest.approx(apart.time(lengths, COSTS))


@pytest.mark.parametrize("seed", range(3))
def test_a_light_long_tail_keeps_the_joint_search(small_rule, seed):
    lengths = batch(seed, 1, size=800)
    assert 0 < search.long_share(lengths, COSTS) < search.APART_SHARE
    plan = search.search_plan(lengths, COSTS, 16)
    joint = search.search_plan(lengths, COSTS, 16, apart=False)
    assert plan.time(lengths, COSTS) == joint.time(lengths, COSTS)


@pytest.mark.parametrize("seed", range(3))
def test_between_the_sizes_the_faster_of_both_plans_wins(monkeypatch, seed):
    monkeypatch.setattr(search, "APART_SEQUENCES", (20, 500))
    lengths = batch(seed, 12)
    plan = search.search_plan(lengths, COSTS, 16)
    validate_schedule(plan, lengths, COSTS, 16)
    joint = search.search_plan(lengths, COSTS, 16, apart=False)
    apart = search.apart_candidate(lengths, COSTS, 16, search.SearchOptions(), None)
    assert plan.time(lengths, COSTS) <= min(joint.time(lengths, COSTS), apart.time(lengths, COSTS)) * (1 + 1e-12)
