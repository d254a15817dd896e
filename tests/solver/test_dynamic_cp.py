"""Megatron-style dynamic CP baseline: the rule on hand-made batches, a naive reference of the same
rule, validity on random batches and clusters, and FlexSP never slower than it."""
from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexsp
from flexsp.lengths import get_distribution
from solver.costs import DegreeCosts
from solver.dynamic_cp import DynamicCPInfeasible, dynamic_cp, group_degrees, megatron_group_size
from solver.schedule import Schedule

PER_GPU = 100   # tokens one GPU holds in the hand-made cost model


def toy_costs(max_degree: int = 8) -> DegreeCosts:
    degrees = tuple(1 << i for i in range(max_degree.bit_length()) if 1 << i <= max_degree)
    return DegreeCosts(degrees=degrees, quad=tuple(1e-6 / d for d in degrees), lin=tuple(1e-3 / d for d in degrees),
                       capacity=tuple(float(PER_GPU * d) for d in degrees), beta1=0.1)


def shape(schedule: Schedule) -> list[list[tuple[int, list[int]]]]:
    """Micro-batches as lists of (degree, sorted sequence ids), in the order the rule built them."""
    return [[(g.degree, sorted(int(i) for i in g.seq_ids)) for g in mb] for mb in schedule.micro_batches]


# --------------------------------------------------------------------------------- the rule, by hand

def test_group_size_is_next_power_of_two_of_length_over_per_rank():
    assert [megatron_group_size(s, 100) for s in (1, 100, 101, 200, 201, 400, 401, 800)] == [1, 1, 2, 2, 4, 4, 8, 8]
    costs = toy_costs(8)
    sizes = group_degrees(np.array([1, 100, 101, 200, 201, 800]), costs, 8)
    assert [costs.degrees[k] for k in sizes] == [1, 1, 2, 2, 4, 8]


def test_group_size_clamped_to_memory_and_to_the_cluster():
    costs = toy_costs(8)
    # per_rank above one GPU's memory: the rule says 1 GPU, 150 tokens need 2
    assert [costs.degrees[k] for k in group_degrees(np.array([150, 90]), costs, 8, max_seqlen_per_rank=200)] == [2, 1]
    # per_rank below: the rule says 8 GPUs for 300 tokens, a 4-GPU cluster offers 4 (which holds 400)
    assert [costs.degrees[k] for k in group_degrees(np.array([300, 30]), costs, 4, max_seqlen_per_rank=50)] == [4, 1]


def test_sequence_longer_than_the_cluster_is_a_clear_error():
    with pytest.raises(DynamicCPInfeasible, match="sequence 1 has 401 tokens") as info:
        dynamic_cp(np.array([10, 401]), toy_costs(8), 6)   # 6 GPUs: the largest group is 4 (400 tokens)
    assert isinstance(info.value, ValueError)


def test_longest_first_least_loaded_ties_by_group_order():
    # 90 60 50 40 open the four 1-GPU groups; 30 joins the least loaded (40^2); then 50^2 and 40^2+30^2
    # tie at 2500 and 10 joins the earlier group (the one holding 50).
    schedule = dynamic_cp(np.array([10, 90, 50, 60, 40, 30]), toy_costs(4), 4)
    assert shape(schedule) == [[(1, [1]), (1, [3]), (1, [0, 2]), (1, [4, 5])]]


def test_five_percent_stop():
    lengths = np.array([50, 49, 5, 5])
    # 50^2 vs 49^2: spread 99 <= 5% of 2500, so the micro-batch closes with the two long ones
    assert shape(dynamic_cp(lengths, toy_costs(2), 2)) == [[(1, [0]), (1, [1])], [(1, [2]), (1, [3])]]
    # at 2% (50) it stays open: both short ones join the less loaded GPU (2401 -> 2426 -> 2451)
    assert shape(dynamic_cp(lengths, toy_costs(2), 2, tolerance=0.02)) == [[(1, [0]), (1, [1, 2, 3])]]
    # at 3% (75) it closes after the first one (spread 2500 - 2426 = 74); the last 5 doubles to 2 GPUs
    assert shape(dynamic_cp(lengths, toy_costs(2), 2, tolerance=0.03)) == [[(1, [0]), (1, [1, 2])], [(2, [3])]]


def test_memory_limit_defers_and_balanced_micro_batches_close():
    # 100 fills GPU 0; 70 + 20 leave 10 tokens on GPU 1, so the other 20s wait; after that every pair
    # of 20s is balanced (spread 0) and closes its own micro-batch.
    schedule = dynamic_cp(np.array([100, 20, 20, 20, 20, 20, 70]), toy_costs(2), 2)
    assert shape(schedule) == [[(1, [0]), (1, [1, 6])], [(1, [2]), (1, [3])], [(1, [4]), (1, [5])]]


def test_sequence_too_big_for_the_free_gpus_waits_shorter_ones_go_first():
    # 3 GPUs: 180 takes a 2-GPU group; 170 needs 2 more, only 1 is free: it waits, 90 goes first;
    # 20 would join 90's GPU but only 10 tokens are left there.
    schedule = dynamic_cp(np.array([180, 170, 90, 20]), toy_costs(2), 3)
    assert shape(schedule) == [[(2, [0]), (1, [2])], [(2, [1]), (1, [3])]]


def test_empty_gpus_double_the_smallest_groups_earliest_first():
    # 8 GPUs: 150 -> 2 GPUs, 80 -> 1, 70 -> 1; 4 left: the 1s double (2 left), then the first 2 doubles
    assert shape(dynamic_cp(np.array([150, 80, 70]), toy_costs(8), 8)) == [[(4, [0]), (2, [1]), (2, [2])]]
    # two groups on 8 GPUs: 1 -> 2, then 2 and 2 -> 4 and 4
    assert shape(dynamic_cp(np.array([150, 80]), toy_costs(8), 8)) == [[(4, [0]), (4, [1])]]
    # 6 GPUs: a 4-GPU group cannot grow to 8, two GPUs stay idle
    assert shape(dynamic_cp(np.array([300]), toy_costs(4), 6)) == [[(4, [0])]]


def test_deterministic_and_independent_of_input_order_up_to_ids():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 800, 200)
    a, b = dynamic_cp(lengths, toy_costs(8), 8), dynamic_cp(lengths, toy_costs(8), 8)
    assert shape(a) == shape(b)


# ------------------------------------------------------------------ a naive reference of the same rule

def reference(lengths: list[int], costs: DegreeCosts, num_gpus: int, tolerance: float = 0.05):
    """The rule as written, scanning every pending sequence and every group (quadratic, tiny batches)."""
    degrees = [d for d in costs.degrees if d <= num_gpus]
    cap = {d: costs.capacity[costs.index(d)] for d in degrees}
    per_rank = costs.capacity[0] / costs.degrees[0]
    size = {}
    for i, s in enumerate(lengths):
        rule = min(megatron_group_size(s, per_rank), degrees[-1])
        size[i] = min(d for d in degrees if d >= rule and cap[d] >= s)
    pending = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out = []
    while pending:
        free, groups, placed = num_gpus, [], []   # group: [degree, members, tokens, sum of squares]
        for i in pending:
            s, d = lengths[i], size[i]
            if free >= d:
                free -= d
                groups.append([d, [], 0, 0])
                g = groups[-1]
            else:
                fits = [g for g in groups if g[0] == d and cap[d] - g[2] >= s]
                if not fits:
                    continue
                g = min(fits, key=lambda g: Fraction(g[3], g[0]))   # min keeps the first of ties
            g[1].append(i), placed.append(i)
            g[2] += s
            g[3] += s * s
            loads = [Fraction(g[3], g[0]) for g in groups] + [Fraction(0)] * free
            if max(loads) - min(loads) <= Fraction(tolerance) * max(loads):
                break
        while True:
            d, j = min((g[0], j) for j, g in enumerate(groups))
            if free < d or 2 * d not in degrees:
                break
            free -= d
            groups[j][0] = 2 * d
        out.append([(g[0], sorted(g[1])) for g in groups])
        pending = [i for i in pending if i not in set(placed)]
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
       st.lists(st.integers(1, 1600), min_size=1, max_size=30), st.sampled_from([0.0, 0.05, 0.3]))
def test_matches_the_naive_reference(num_gpus, lengths, tolerance):
    costs = toy_costs(16)
    top = max(d for d in costs.degrees if d <= num_gpus)
    lengths = [min(s, PER_GPU * top) for s in lengths]
    assert shape(dynamic_cp(np.array(lengths), costs, num_gpus, tolerance=tolerance)) == \
        reference(lengths, costs, num_gpus, tolerance)


# ------------------------------------------------------------------- random batches on random clusters

@st.composite
def problems(draw):
    nodes = draw(st.sampled_from(["one-node", "multi-node"]))
    num_gpus = draw(st.integers(1, 8)) if nodes == "one-node" else 8 * draw(st.integers(1, 32))
    cluster = flexsp.Cluster(num_gpus=num_gpus, gpus_per_node=8)
    degrees = [d for d in cluster.degrees if d > 1]
    cost = flexsp.CostModel(
        alpha1=draw(st.floats(1e-10, 1e-8)), alpha2=draw(st.floats(1e-5, 1e-3)), beta1=draw(st.floats(0.0, 1.0)),
        comm_bytes_per_token=draw(st.floats(0.0, 2e6)),
        alltoall_bandwidth={d: draw(st.floats(1e9, 2e11)) for d in degrees},
        token_capacity=draw(st.integers(16, 8000)))
    whole = int(cost.token_capacity * cluster.degrees[-1])   # the largest group the cluster holds
    one = int(cost.token_capacity)
    lengths = draw(st.lists(st.one_of(st.integers(1, one), st.integers(1, whole)), min_size=1, max_size=40))
    return np.array(lengths, dtype=np.int64), cost, cluster


def independent_check(plan: flexsp.Plan, lengths: np.ndarray, cost: flexsp.CostModel, num_gpus: int) -> None:
    seen = []
    for mb in plan.micro_batches:
        assert mb.groups
        assert sum(g.degree for g in mb.groups) <= num_gpus
        for g in mb.groups:
            d = len(g.ranks)
            assert d >= 1 and d & (d - 1) == 0 and d <= num_gpus
            assert g.seq_ids
            assert int(lengths[list(g.seq_ids)].sum()) <= cost.token_capacity * d
            seen.extend(g.seq_ids)
    assert sorted(seen) == list(range(len(lengths)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plans_are_valid_on_random_batches_and_clusters(problem):
    lengths, cost, cluster = problem
    plan = flexsp.plan_batch(lengths, cost, cluster, strategy="dynamic-cp")   # runs plan.validate
    independent_check(plan, lengths, cost, cluster.num_gpus)
    assert plan.predicted_time == pytest.approx(plan.time(lengths, cost), rel=1e-9)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_flexsp_is_never_slower_than_dynamic_cp(problem):
    lengths, cost, cluster = problem
    ours = flexsp.plan_batch(lengths, cost, cluster, strategy="flexsp", time_limit=5.0)
    theirs = flexsp.plan_batch(lengths, cost, cluster, strategy="dynamic-cp")
    assert ours.predicted_time <= theirs.predicted_time * (1 + 1e-9)


def test_planner_rejects_a_sequence_longer_than_the_cluster():
    cost = flexsp.CostModel(alpha1=1e-9, alpha2=1e-4, beta1=0.1, comm_bytes_per_token=1e5,
                            alltoall_bandwidth={2: 1e11, 4: 1e11}, token_capacity=100)
    with pytest.raises(flexsp.PlanError):
        flexsp.plan_batch([401], cost, flexsp.Cluster(4), strategy="dynamic-cp")


def test_scales_about_linearly_131072_sequences_on_16384_gpus():
    cost = flexsp.CostModel.from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    degrees = flexsp.Cluster(16384).degrees
    costs = DegreeCosts(degrees, tuple(1e-9 / d for d in degrees), tuple(1e-4 / d for d in degrees),
                        tuple(cost.token_capacity * d for d in degrees), 0.6)
    lengths = get_distribution("wikipedia").sample_batch(131072, 0)
    started = time.perf_counter()
    schedule = dynamic_cp(lengths, costs, 16384)
    assert time.perf_counter() - started < 15
    assert schedule.num_sequences == len(lengths)
