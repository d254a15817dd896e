"""The refined bound is a bound (never above the exhaustive optimum nor any plan), never below the coupled one,
and tighter than it where micro-batches of different lengths and groups of different degrees share a step."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_bounds import memory_bound_instances
from test_planner import make_cost, tiny_instances
from validator import brute_force_optimum

import flexsp
from flexsp.plan.bounds import coupled_lower_bound
from flexsp.plan.lengths import get_distribution
from flexsp.plan.refined_bound import refined_lower_bound


def check_between(instance, solves: int) -> tuple[float, float]:
    cluster, cost, lengths = instance
    optimum = brute_force_optimum(lengths, cost, cluster.num_gpus)
    coupled = coupled_lower_bound(lengths, cost, cluster)
    refined = refined_lower_bound(lengths, cost, cluster, solves=solves)
    assert coupled * (1 - 1e-9) <= refined <= optimum * (1 + 1e-9)
    return refined, coupled


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_instances())
def test_refined_bound_never_exceeds_the_brute_force_optimum(instance):
    check_between(instance, solves=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(memory_bound_instances())
def test_refined_bound_of_batches_that_memory_splits_never_exceeds_the_optimum(instance):
    check_between(instance, solves=40)


def test_every_count_below_the_best_is_refined():
    """Two 108-token sequences on 6 GPUs of 71 tokens: one micro-batch of two groups or two micro-batches. The
    coupled bound of the one-micro-batch plan (1.67 s) is far below its optimum; refining it alone and stopping at
    the next count's coupled value (1.94 s) would leave the answer there. Refined count by count it meets the
    optimum (2.3676 s: one micro-batch, each sequence on 2 GPUs) within 0.1%."""
    cost = flexsp.CostModel(alpha1=0.0, alpha2=0.00667395986669196, beta1=0.2680373809075686,
                            comm_bytes_per_token=1e6, token_capacity=71.0, window_alpha={9: 0.0017384194260273186},
                            alltoall_bandwidth={2: 56183669.0, 3: 51800220.3, 4: 262341474.5, 5: 133852137.6,
                                                6: 235068732.1})
    cluster = flexsp.Cluster(6, 1)
    refined, coupled = check_between((cluster, cost, [108, 108]), solves=120)
    assert coupled == pytest.approx(1.6677, rel=1e-4)
    assert refined == pytest.approx(2.36756, rel=1e-3)      # at 120 solves, within 0.1% of the optimum


def test_bounds_refuse_what_plan_batch_refuses():
    from flexsp.errors import LengthsError
    cost, cluster = make_cost(200, 4, seed=1), flexsp.Cluster(4, 4)
    with pytest.raises(LengthsError, match=r"lengths\[0\] = 0 is not a valid sequence length"):
        refined_lower_bound([0, 5], cost, cluster)


def test_no_solves_leaves_the_coupled_bound():
    cost = make_cost(200, 4, seed=1)
    cluster = flexsp.Cluster(4, 4)
    lengths = [700, 400, 150, 150, 90, 60]
    assert refined_lower_bound(lengths, cost, cluster, solves=0) == pytest.approx(coupled_lower_bound(lengths, cost, cluster))


def test_refined_bound_is_tighter_on_a_mixed_batch_and_below_the_plan():
    """512 Wikipedia lengths on 64 GPUs with the paper's gpt-7b constants: two micro-batches, long sequences at
    degrees 2-16 beside short ones on one GPU. The coupled LP pools each micro-batch's memory and lets its
    largest use all of its budget; kept apart per degree and per micro-batch the bound rises by several percent
    (1.12 -> 1.07 of the plan), and stays below the plan."""
    cost = flexsp.cost_from_preset("gpt-7b", num_gpus=64)
    cluster = flexsp.Cluster(64, 8)
    pool = get_distribution("wikipedia").lengths
    lengths = -(-pool[np.random.default_rng(64).integers(0, pool.size, size=512)] // 128) * 128
    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp")
    coupled = coupled_lower_bound(lengths, cost, cluster)
    refined = refined_lower_bound(lengths, cost, cluster)
    assert refined > coupled * 1.02
    assert refined <= plan.predicted_time * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_refined_bound_below_every_plan_on_larger_batches(seed):
    rng = np.random.default_rng(seed)
    num_gpus = int(rng.choice([8, 16, 32]))
    cost = make_cost(int(rng.integers(500, 4000)), num_gpus, seed)
    cluster = flexsp.Cluster(num_gpus, 8)
    cap = cost.token_capacity * num_gpus
    lengths = np.minimum(rng.lognormal(np.log(cost.token_capacity), 1.2, size=int(rng.integers(20, 120))), cap)
    lengths = np.maximum(lengths.astype(np.int64), 1)
    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=5.0)
    refined = refined_lower_bound(lengths, cost, cluster, solves=60)
    assert coupled_lower_bound(lengths, cost, cluster) * (1 - 1e-9) <= refined <= plan.predicted_time * (1 + 1e-9)
