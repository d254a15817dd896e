"""plan_batch end to end: validity on random inputs, optimality on tiny ones, strategy order, errors."""
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from validator import brute_force_optimum, check_plan

import flexsp

STRATEGIES = ("flexsp", "greedy", "batchada", "static")


def make_cost(capacity: int, num_gpus: int, seed: int = 0) -> flexsp.CostModel:
    """A cost model with the paper's shape: fast NVLink inside a node, slow links across."""
    rng = np.random.default_rng(seed)
    bandwidth, d = {}, 2
    while d <= max(num_gpus, 2):
        bandwidth[d] = (1.2e11 if d <= 8 else 1.0e10) * rng.uniform(0.7, 1.0)
        d *= 2
    return flexsp.CostModel(alpha1=5e-9 * rng.uniform(0.5, 2), alpha2=1.8e-4 * rng.uniform(0.5, 2),
                            beta1=0.6 * rng.uniform(0.1, 1.5), comm_bytes_per_token=2_097_152,
                            alltoall_bandwidth=bandwidth, token_capacity=capacity)


@st.composite
def instances(draw, max_gpus=256, max_len=None):
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, max(1, max_gpus // gpus_per_node)))
    num_gpus = gpus_per_node * nodes if draw(st.booleans()) else draw(st.integers(1, gpus_per_node))
    capacity = draw(st.integers(64, 8192))
    cluster_cap = capacity * (1 << (num_gpus.bit_length() - 1))
    top = min(cluster_cap, max_len or cluster_cap)
    lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=48))
    return flexsp.Cluster(num_gpus, gpus_per_node), make_cost(capacity, num_gpus, draw(st.integers(0, 99))), lengths


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_every_strategy_gives_valid_plans_with_every_sequence_once(instance):
    cluster, cost, lengths = instance
    times = {}
    for strategy in STRATEGIES:
        plan = flexsp.plan_batch(lengths, cost, cluster, strategy, time_limit=5.0)
        times[strategy] = check_plan(plan.to_dict(), lengths, cost, cluster.num_gpus, cluster.gpus_per_node)
        plan.validate(lengths, cost, cluster)
    # flexsp <= batchada <= static on the same batch (each plan is a candidate of the next)
    assert times["flexsp"] <= times["batchada"] * (1 + 1e-9)
    assert times["batchada"] <= times["static"] * (1 + 1e-9)


@st.composite
def tiny_instances(draw):
    num_gpus = draw(st.sampled_from([1, 2, 4, 8]))
    capacity = draw(st.integers(50, 400))
    lengths = draw(st.lists(st.integers(1, capacity * num_gpus), min_size=1, max_size=6))
    return flexsp.Cluster(num_gpus, 8), make_cost(capacity, num_gpus, draw(st.integers(0, 99))), lengths


# Tolerance 1e-6 relative: the MILP is solved to a 1e-9 relative gap (solver.milp.MIP_REL_GAP) and
# times are floats. A real miss can be small: in the example below two 349-token sequences on two
# groups of 4 GPUs beat both on one group of 8 by 2e-5 relative, which HiGHS's default gap (1e-4) let
# pass. Hypothesis draws fresh examples on every run (CI starts without its database), so a case
# that once failed is pinned here with @example and runs every time.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_instances())
@example((flexsp.Cluster(8, 8),
          flexsp.CostModel(alpha1=7.708689280055519e-09, alpha2=0.0002661741224334153, beta1=0.7850181163477868,
                           comm_bytes_per_token=2097152.0, token_capacity=131.0,
                           alltoall_bandwidth={2: 97957195402.2814, 4: 105447845641.05624, 8: 102496819621.94437}),
          [48, 349, 349, 393, 614, 614]))
def test_flexsp_matches_brute_force_on_tiny_batches(instance):
    cluster, cost, lengths = instance
    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=60.0)
    assert plan.predicted_time == pytest.approx(brute_force_optimum(lengths, cost, cluster.num_gpus), rel=1e-6)


def test_brute_force_case_needing_several_micro_batches():
    cost = make_cost(capacity=100, num_gpus=4, seed=3)
    lengths = [390, 350, 120, 60, 30, 10, 5]          # 965 tokens > 400 of memory: at least 3 passes
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(4), "flexsp", time_limit=60.0)
    assert len(plan.micro_batches) >= 3
    assert plan.predicted_time == pytest.approx(brute_force_optimum(lengths, cost, 4), rel=1e-6)


def test_paper_setting_beats_static_and_batchada():
    from flexsp.plan.lengths import get_distribution, preprocess
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    lengths, _ = preprocess(get_distribution("wikipedia").sample_batch(512, 7), 384 * 1024, 64)
    cluster = flexsp.Cluster(64, 8)
    plans = {s: flexsp.plan_batch(lengths, cost, cluster, s) for s in STRATEGIES}
    for plan in plans.values():
        check_plan(plan.to_dict(), lengths, cost, 64, 8)
    assert plans["static"].predicted_time / plans["flexsp"].predicted_time > 1.5
    assert plans["flexsp"].predicted_time <= plans["batchada"].predicted_time
    assert len(plans["flexsp"].degree_histogram()) > 1            # really heterogeneous


def test_deterministic():
    """Deterministic while the wall-clock safety net does not fire (a loaded CI box can make a 0.2 s
    search take 2 s, the default limit; tests/solver/test_determinism.py covers the firing case)."""
    cost = make_cost(2000, 32, seed=1)
    lengths = np.random.default_rng(5).integers(1, 30_000, size=300)
    a = flexsp.plan_batch(lengths, cost, flexsp.Cluster(32, 8), "flexsp", time_limit=120)
    b = flexsp.plan_batch(lengths, cost, flexsp.Cluster(32, 8), "flexsp", time_limit=120)
    assert "time_limit_hit" not in a.meta and "time_limit_hit" not in b.meta
    assert a.to_dict()["micro_batches"] == b.to_dict()["micro_batches"]


def test_a_tight_time_limit_still_returns_a_valid_plan():
    cost = make_cost(2000, 64, seed=2)
    lengths = np.random.default_rng(6).integers(1, 60_000, size=2000)
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(64, 8), "flexsp", time_limit=1e-3)
    check_plan(plan.to_dict(), lengths, cost, 64, 8)


def test_a_tight_time_limit_warns_at_the_callers_line_and_the_collector_comes_back():
    """``plan_batch`` pauses the cyclic GC while it plans: it runs again afterwards (and stays off for a
    caller that turned it off), and the time-limit warning still names the caller's file."""
    import gc

    from flexsp.plan.planner import TimeLimitWarning
    cost = make_cost(2000, 64, seed=2)
    lengths = np.random.default_rng(6).integers(1, 60_000, size=2000)
    with pytest.warns(TimeLimitWarning) as caught:
        flexsp.plan_batch(lengths, cost, flexsp.Cluster(64, 8), "flexsp", time_limit=1e-3)
    assert caught[0].filename == __file__
    assert gc.isenabled()
    gc.disable()
    try:
        flexsp.plan_batch(lengths[:20], cost, flexsp.Cluster(64, 8))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("lengths, error, message", [
    ([], flexsp.LengthsError, "empty"),
    ([100, 0], flexsp.LengthsError, r"lengths\[1\] = 0"),
    ([100, -5], flexsp.LengthsError, r"lengths\[1\] = -5"),
    ([100, 2.5], flexsp.LengthsError, "whole number"),
    ([100, 10_000_000], flexsp.PlanError, "sequence 1 has 10000000 tokens, more than the whole cluster can hold"),
])
def test_bad_batches_are_named(lengths, error, message):
    with pytest.raises(error, match=message):
        flexsp.plan_batch(lengths, make_cost(1000, 8), flexsp.Cluster(8))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=0), "num_gpus must be >= 1"),
    (dict(num_gpus=12, gpus_per_node=8), "not a multiple of gpus_per_node=8"),
    (dict(num_gpus=8, gpus_per_node=6), "not a multiple of gpus_per_node=6"),
    (dict(num_gpus=2.5), "num_gpus must be an integer"),
])
def test_bad_clusters_are_named(kwargs, message):
    with pytest.raises(flexsp.ClusterError, match=message):
        flexsp.Cluster(**kwargs)


def test_non_power_of_two_cluster_is_fine():
    cluster = flexsp.Cluster(48, 8)
    assert cluster.degrees[-1] == 32
    cost = make_cost(1000, 32)
    plan = flexsp.plan_batch([30_000, 500, 200, 9000], cost, cluster)
    check_plan(plan.to_dict(), [30_000, 500, 200, 9000], cost, 48, 8)


def test_unknown_strategy_and_static_degree():
    cost = make_cost(1000, 8)
    with pytest.raises(flexsp.PlanError, match="unknown strategy 'fast'"):
        flexsp.plan_batch([10], cost, flexsp.Cluster(8), "fast")
    with pytest.raises(flexsp.PlanError, match="cannot hold a sequence|holds at most"):
        flexsp.plan_batch([5000], cost, flexsp.Cluster(8), "static", sp_degree=2)


@pytest.mark.parametrize("num_gpus", [4096, 16384])
@pytest.mark.parametrize("degrees", [None, (1, 8, 64, 512)])
def test_large_clusters_small_batches_every_strategy(num_gpus, degrees):
    from flexsp.plan.analytic import analytic_cost_model
    cost = analytic_cost_model("llama-7b", "h100-80gb", num_gpus=num_gpus)
    cluster = flexsp.Cluster(num_gpus, 8)
    rng = np.random.default_rng(num_gpus)
    lengths = np.concatenate([rng.integers(1, 8000, size=30), [2 * 1024 * 1024 - 5, 700_000]])
    allowed = set(degrees or cluster.degrees)
    for strategy in ("flexsp", "greedy", "batchada", "dynamic-cp"):
        plan = flexsp.plan_batch(lengths, cost, cluster, strategy, degrees=degrees)
        check_plan(plan.to_dict(), lengths, cost, num_gpus, 8)
        used = {g.degree for mb in plan.micro_batches for g in mb.groups}
        assert used <= allowed, (strategy, used)
    static = flexsp.plan_batch(lengths, cost, cluster, "static", degrees=degrees)
    assert {g.degree for mb in static.micro_batches for g in mb.groups} == {max(allowed)}


def test_a_2m_sequence_on_too_small_a_cluster_names_length_and_capacity():
    from flexsp.plan.analytic import analytic_cost_model
    cost = analytic_cost_model("llama-7b", "h100-80gb", num_gpus=64)
    with pytest.raises(flexsp.PlanError, match=r"sequence 1 has 2097152 tokens, more than the whole cluster can hold: "
                                               r"64 GPUs x \d+ tokens = \d+"):
        flexsp.plan_batch([1000, 2 * 1024 * 1024], cost, flexsp.Cluster(64, 8))


def test_usable_degrees_is_a_cluster_fact():
    cluster = flexsp.Cluster(16, 8)
    assert cluster.usable_degrees() == (1, 2, 4, 8, 16)
    assert cluster.usable_degrees(8, (1, 8, 16)) == (1, 8)
