"""The subset DP of tiny batches: its plans are the brute-force optimum and the MILP's, it needs no
MILP and no deadline, and on degrees that do not nest it returns only plans that place."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from validator import brute_force_optimum, check_plan

import flexsp
import solver.search
from flexsp.plan.token_budget import token_budget_cost
from flexsp.plan.planner import solver_costs
from solver.bucketing import exact_buckets
from solver.exact import MAX_SEQUENCES, exact_plan, subset_pairs
from solver.milp import solve_milp
from test_planner import make_cost


def costs_of(cost, cluster, degrees=None):
    return solver_costs(cost, cluster, cluster.usable_degrees(None, degrees))[0]


@st.composite
def tiny(draw):
    num_gpus = draw(st.sampled_from([1, 2, 4, 8]))
    capacity = draw(st.integers(50, 400))
    lengths = draw(st.lists(st.integers(1, capacity * num_gpus), min_size=1, max_size=6))
    return flexsp.Cluster(num_gpus, 8), make_cost(capacity, num_gpus, draw(st.integers(0, 99))), np.array(lengths)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny())
def test_the_plan_is_the_brute_force_optimum(instance):
    cluster, cost, lengths = instance
    costs = costs_of(cost, cluster)
    plan = exact_plan(lengths, costs, cluster.num_gpus)
    assert plan is not None
    assert sorted(np.concatenate([g.seq_ids for mb in plan.micro_batches for g in mb]).tolist()) == list(range(len(lengths)))
    for mb in plan.micro_batches:
        assert sum(g.degree for g in mb) <= cluster.num_gpus
        assert all(lengths[g.seq_ids].sum() <= costs.capacity[costs.index(g.degree)] for g in mb)
    assert plan.time(lengths, costs) == pytest.approx(brute_force_optimum(list(lengths), cost, cluster.num_gpus), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_eight_sequences_match_the_milp(seed):
    """Eight sequences (beyond what the brute force enumerates quickly): the MILP's optimum on one
    bucket per distinct length, solved to its 1e-9 gap, is the DP's."""
    rng = np.random.default_rng(seed)
    cluster, cost = flexsp.Cluster(4, 4), make_cost(200, 4, seed)
    lengths = rng.integers(1, 500, size=8)
    costs = costs_of(cost, cluster)
    plan = exact_plan(lengths, costs, 4)
    exact = exact_buckets(lengths)
    milp = solve_milp(exact.upper, costs.times(exact.upper), exact.counts, costs, 4, len(lengths), 60.0)
    assert milp is not None and milp.optimal
    assert plan.time(lengths, costs) == pytest.approx(milp.objective, rel=1e-7)


def test_plan_batch_proves_tiny_batches_without_the_milp(monkeypatch):
    """The HF Trainer's default cost, 8 sequences on 4 ranks: 0.5-1 s of MILP (often to the 1 s deadline)
    before; now the DP, whatever the time limit."""
    def no_milp(*a, **k):
        raise AssertionError("the MILP ran")
    monkeypatch.setattr(solver.search, "solve_milp", no_milp)
    cost, cluster = token_budget_cost(2, 64, 4, 96), flexsp.Cluster(4, 4)
    rng = np.random.default_rng(0)
    for _ in range(4):
        lengths = np.clip(rng.lognormal(3.0, 0.9, 8).astype(int), 2, 288)
        plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=30.0)
        assert "time_limit_hit" not in plan.meta
        check_plan(plan.to_dict(), lengths, cost, 4, 4)


def test_non_nesting_degrees_place_or_fall_back():
    """Degrees 1..6 on 6 GPUs (tiles that do not nest): a DP plan is returned only when every
    micro-batch places; plan_batch's plan (DP or search) validates either way."""
    cluster = flexsp.Cluster(6, 6)
    cost = flexsp.CostModel(alpha1=5e-9, alpha2=1.8e-4, beta1=0.3, comm_bytes_per_token=2_097_152,
                            alltoall_bandwidth={d: 1e11 / d for d in range(2, 7)}, token_capacity=300)
    costs = costs_of(cost, cluster, "any")
    assert costs.placeable is not None
    rng = np.random.default_rng(3)
    for _ in range(5):
        lengths = rng.integers(1, 1500, size=6)
        plan = exact_plan(lengths, costs, 6)
        if plan is not None:
            for mb in plan.micro_batches:
                counts = np.zeros(costs.num_degrees, dtype=np.int64)
                for g in mb:
                    counts[costs.index(g.degree)] += 1
                assert costs.placeable(counts)
        flexsp.plan_batch(lengths, cost, cluster, "flexsp", degrees="any", time_limit=30.0)   # validates


def test_subset_pairs_cover_every_split_once():
    for n in (1, 3, 5):
        s, t, r = subset_pairs(n)
        assert len(s) == (3 ** n - 1) // 2
        assert np.all((t & s) == t) and np.all((s & -s) & t) and np.all(r == s ^ t)
        assert len(set(zip(s.tolist(), t.tolist()))) == len(s)


def test_out_of_range_is_none():
    costs = costs_of(make_cost(100, 4), flexsp.Cluster(4, 4))
    assert exact_plan(np.full(MAX_SEQUENCES + 1, 10), costs, 4) is None
    assert exact_plan(np.array([10_000]), costs, 4) is None       # holds nowhere: the search names it
