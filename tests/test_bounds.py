"""Both lower bounds are bounds (never above the exhaustive optimum) and the coupled one is tighter
where a long sequence's minimum time meets the memory limit."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner import make_cost, tiny_instances
from validator import brute_force_optimum

import flexsp
from flexsp.plan.bounds import coupled_lower_bound, lower_bound


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_instances())
def test_bounds_never_exceed_the_brute_force_optimum(instance):
    cluster, cost, lengths = instance
    optimum = brute_force_optimum(lengths, cost, cluster.num_gpus)
    simple = lower_bound(lengths, cost, cluster)
    coupled = coupled_lower_bound(lengths, cost, cluster)
    assert simple <= optimum * (1 + 1e-9)
    assert coupled <= optimum * (1 + 1e-9)
    assert coupled >= simple * (1 - 1e-5)          # never looser than the simple bound


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_coupled_bound_below_every_plan_on_larger_batches(seed):
    rng = np.random.default_rng(seed)
    num_gpus = int(rng.choice([8, 16, 32]))
    cost = make_cost(int(rng.integers(500, 4000)), num_gpus, seed % 100)
    cluster = flexsp.Cluster(num_gpus, 8)
    cap = cost.token_capacity * num_gpus
    lengths = np.minimum(rng.lognormal(np.log(cost.token_capacity), 1.2, size=int(rng.integers(4, 80))), cap)
    lengths = np.maximum(lengths.astype(np.int64), 1)
    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=5.0)
    coupled = coupled_lower_bound(lengths, cost, cluster)
    assert lower_bound(lengths, cost, cluster) * (1 - 1e-5) <= coupled <= plan.predicted_time * (1 + 1e-9)


def test_coupled_bound_is_tighter_when_a_long_sequence_needs_a_big_group():
    """The long sequence is cheapest in GPU-seconds on 1 GPU, but there it alone takes 1.0 s while
    the work spread over 4 GPUs takes 0.5 s: any plan either waits for it or runs it on 2 GPUs
    at more GPU-seconds (communication). The simple bound charges 0.5 s; the coupled bound sees
    the trade and meets the exhaustive optimum (0.625 s: it on 2 GPUs, the others on one each)."""
    cost = flexsp.CostModel(alpha1=0.0, alpha2=1e-3, beta1=0.01, comm_bytes_per_token=1e3,
                            alltoall_bandwidth={2: 4e6, 4: 1e6}, token_capacity=1000)
    cluster = flexsp.Cluster(4, 4)
    lengths = [1000, 500, 500]
    optimum = brute_force_optimum(lengths, cost, 4)
    simple, coupled = lower_bound(lengths, cost, cluster), coupled_lower_bound(lengths, cost, cluster)
    assert optimum == pytest.approx(0.635)
    assert simple == pytest.approx(0.51)
    assert coupled == pytest.approx(optimum, rel=1e-5) and coupled <= optimum


def test_the_largest_micro_batch_leaves_time_for_the_tokens_it_cannot_hold(monkeypatch):
    """250 tokens on 2 GPUs of 100 each need two micro-batches, and 50 tokens (0.055 GPU-s at their cheapest)
    run outside the larger, so it has at most S - 0.0275 s, not all of S. The 100-token sequence takes 0.12 s
    on one GPU (0.33 GPU-s on two): S >= 0.1475, where the LP that gave the largest micro-batch all of S
    stopped at the spread work, 0.1425. Both below the exhaustive optimum (0.177)."""
    from flexsp.plan import bounds
    cost = flexsp.CostModel(alpha1=2e-6, alpha2=1e-3, beta1=0.001, comm_bytes_per_token=2_097_152,
                            alltoall_bandwidth={2: 1e9}, token_capacity=100)
    cluster = flexsp.Cluster(2, 1)
    lengths = [100, 50, 50, 50]
    optimum = brute_force_optimum(lengths, cost, 2)
    tight = coupled_lower_bound(lengths, cost, cluster, memory_split=False)
    # what the later micro-batches must run: the cheapest tokens first, none when the largest holds everything,
    # and no time for sequences without tokens
    assert bounds._forced_work(np.array([0.0, 10.0, 10.0]), np.array([5.0, 3.0, 9.0]), 15.0, 1, 2).tolist() == [1.5, 0.0]
    assert bounds._forced_work(np.array([0.0, 10.0]), np.array([5.0, 10.0]), 100.0, 1, 2).tolist() == [0.0, 0.0]
    monkeypatch.setattr(bounds, "_forced_work", lambda lengths, area, memory, n, count: np.zeros(count))
    loose = coupled_lower_bound(lengths, cost, cluster, memory_split=False)
    assert optimum == pytest.approx(0.177)
    assert loose == pytest.approx(0.1425 + 2 * 0.001, rel=1e-5)
    assert tight == pytest.approx(0.1475 + 2 * 0.001, rel=1e-5) and tight <= optimum


@st.composite
def memory_bound_instances(draw):
    """Tiny batches that need several micro-batches, with long sequences slow enough (a large attention term,
    slow links past one node) that their degree depends on the time their micro-batch has."""
    num_gpus = draw(st.sampled_from([2, 4, 8]))
    node = draw(st.sampled_from([1, 2]))
    capacity = draw(st.integers(50, 300))
    lengths = draw(st.lists(st.integers(1, capacity * num_gpus), min_size=2, max_size=6)
                   .filter(lambda x: sum(x) > capacity * num_gpus))
    bandwidth = {d: 1.2e11 if d <= node else draw(st.floats(3e8, 3e10)) for d in (2, 4, 8) if d <= num_gpus}
    cost = flexsp.CostModel(alpha1=draw(st.floats(1e-8, 1e-5)), alpha2=draw(st.floats(9e-5, 3.6e-4)),
                            beta1=draw(st.floats(1e-3, 0.1)), comm_bytes_per_token=2_097_152,
                            alltoall_bandwidth=bandwidth, token_capacity=capacity)
    return flexsp.Cluster(num_gpus, node), cost, lengths


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(memory_bound_instances())
def test_bounds_of_batches_that_memory_splits_never_exceed_the_optimum(instance):
    cluster, cost, lengths = instance
    optimum = brute_force_optimum(lengths, cost, cluster.num_gpus)
    for memory_split in (True, False):
        assert coupled_lower_bound(lengths, cost, cluster, memory_split=memory_split) <= optimum * (1 + 1e-9)


def test_coupled_bound_equals_simple_when_nothing_couples():
    """Many equal short sequences: perfect spreading is achievable up to rounding, both agree."""
    cost = make_cost(4096, 8)
    cluster = flexsp.Cluster(8, 8)
    lengths = [512] * 64
    assert coupled_lower_bound(lengths, cost, cluster) == pytest.approx(lower_bound(lengths, cost, cluster), rel=1e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_gap_breakdown_sums_to_the_plan_time_with_nonnegative_waste(seed):
    from flexsp.plan.bounds import gap_breakdown
    rng = np.random.default_rng(seed)
    num_gpus = int(rng.choice([8, 16]))
    cost = make_cost(int(rng.integers(500, 4000)), num_gpus, seed % 100)
    cluster = flexsp.Cluster(num_gpus, 8)
    lengths = np.maximum(rng.lognormal(np.log(cost.token_capacity), 1.0, size=int(rng.integers(4, 40))), 1)
    lengths = np.minimum(lengths, cost.token_capacity * num_gpus).astype(np.int64)
    for strategy in ("flexsp", "static"):
        plan = flexsp.plan_batch(lengths, cost, cluster, strategy, time_limit=5.0)
        parts = gap_breakdown(plan, lengths, cost, cluster)
        assert sum(parts.values()) == pytest.approx(plan.predicted_time, rel=1e-9)
        assert parts["degree"] >= -1e-9 * plan.predicted_time and parts["idle"] >= -1e-9 * plan.predicted_time
        assert parts["extra_micro_batches"] >= 0
        # the simple bound is the same perfect spread plus beta1 for the fewest micro-batches memory allows
        assert lower_bound(lengths, cost, cluster) == pytest.approx(parts["area"] + parts["beta1"], rel=1e-9)
