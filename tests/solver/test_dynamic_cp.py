"""Megatron-Core dynamic CP baseline: upstream's own plans (fixture), a rank-level transcription of
upstream's rule as the reference on random batches, hand-made cases of each step of the rule,
validity on random clusters, and FlexSP never slower than it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexsp
from flexsp.plan.lengths import get_distribution, preprocess
from solver.dynamic_cp import DynamicCPInfeasible, dynamic_cp, group_degrees, megatron_group_size
from solver.types import DegreeCosts, GroupAssignment, Schedule

PER_GPU = 100   # tokens one GPU holds in the hand-made cost model
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_dynamic_cp"


def toy_costs(max_degree: int = 8) -> DegreeCosts:
    degrees = tuple(1 << i for i in range(max_degree.bit_length()) if 1 << i <= max_degree)
    return DegreeCosts(degrees=degrees, quad=tuple(1e-6 / d for d in degrees), lin=tuple(1e-3 / d for d in degrees),
                       capacity=tuple(float(PER_GPU * d) for d in degrees), beta1=0.1)


def shape(schedule: Schedule) -> list[list[tuple[int, list[int]]]]:
    """Micro-batches as lists of (degree, sorted sequence ids), groups in the order the rule opened
    them (upstream's rank order)."""
    return [[(g.degree, sorted(int(i) for i in g.seq_ids)) for g in mb] for mb in schedule.micro_batches]


# ------------------------------------------------------------- upstream's rule, transcribed rank by rank

def upstream_rule(lengths, num_gpus, size_of, cap_of, delta=0.05):
    """``BalancedCPScheduler.get_groups_and_subsamples`` as the fixture README describes it, written
    the slow way upstream is: per-rank float loads, lists of ranks, a full scan per sequence, plus the
    per-group token cap ``cap_of(size)``. Doubling stops at ``num_gpus`` (no group of ``num_gpus``
    GPUs when it is not a power of two, the stand-in's documented departure)."""
    est = lambda s: s * s / size_of(s)   # noqa: E731
    pending = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out = []
    while pending:
        k = len({size_of(lengths[i]) for i in pending})
        target = sum(est(lengths[i]) for i in pending) / k
        buckets, cur, work, left_k = [], [], 0.0, k
        for pos, i in enumerate(pending):
            if cur and (work + est(lengths[i]) > target * 1.1 or len(pending) - pos <= left_k - len(buckets)):
                buckets.append(cur)
                cur, work, left_k = [], 0.0, left_k - 1
            cur.append(i)
            work += est(lengths[i])
        buckets.append(cur)
        owner, load, groups = [None] * num_gpus, [0.0] * num_gpus, []
        first, check = None, False
        while buckets:
            pick = None
            for bucket in buckets:
                if bucket:
                    s = lengths[bucket[0]]
                    d = size_of(s)
                    if owner.count(None) >= d or any(g["size"] == d and g["tokens"] + s <= cap_of(d) for g in groups):
                        pick = bucket
                        break
            if pick is None:
                break
            i = pick.pop(0)
            s, d = lengths[i], size_of(lengths[i])
            first = d if first is None else first
            free = [r for r in range(num_gpus) if owner[r] is None]
            if len(free) >= d:
                g = {"size": d, "ranks": free[:d], "seqs": [], "tokens": 0}
                groups.append(g)
                for r in g["ranks"]:
                    owner[r] = g
            else:
                g = min((g for g in groups if g["size"] == d and g["tokens"] + s <= cap_of(d)),
                        key=lambda g: load[g["ranks"][0]])
            g["seqs"].append(i)
            g["tokens"] += s
            for r in g["ranks"]:
                load[r] += est(s)
            while buckets and not buckets[0]:
                buckets.pop(0)
            check = check or d < first
            if check and buckets and max(load) - min(load) <= delta * max(load):
                break
        leftovers = [i for bucket in buckets for i in bucket]
        while True:   # trim_overload
            hi, lo = max(load), min(load)
            if hi - lo <= delta * hi or lo == 0:
                break
            g = owner[load.index(hi)]
            if len(g["seqs"]) <= 1:
                break
            i = g["seqs"][-1]
            after = list(load)
            for r in g["ranks"]:
                after[r] -= est(lengths[i])
            if max(after) - min(after) >= hi - lo:
                break
            g["seqs"].pop()
            g["tokens"] -= lengths[i]
            load = after
            leftovers.append(i)
        free = owner.count(None)
        while free:   # fill_empty_gpus
            g = min(groups, key=lambda g: g["size"])   # the first of the smallest, in rank order
            if free < g["size"] or 2 * g["size"] > num_gpus:
                break
            free -= g["size"]
            g["size"] *= 2
        out.append([(g["size"], sorted(g["seqs"])) for g in groups])
        pending = leftovers
    return out


def capped_sizes(costs: DegreeCosts, num_gpus: int, per_rank: float):
    """The stand-in's size rule for the reference: Megatron's size, raised to what holds the sequence
    and lowered to the largest degree within ``num_gpus`` (both no-ops where upstream itself runs)."""
    degrees = [d for d in costs.degrees if d <= num_gpus]
    cap = dict(zip(costs.degrees, costs.capacity))

    def size_of(s):
        rule = min(megatron_group_size(s, per_rank), degrees[-1])
        return min(d for d in degrees if d >= rule and cap[d] >= s)
    return size_of, cap.__getitem__


def big_costs(max_degree: int = 2, per_gpu: int = 1000) -> DegreeCosts:
    degrees = tuple(1 << i for i in range(max_degree.bit_length()) if 1 << i <= max_degree)
    return DegreeCosts(degrees=degrees, quad=tuple(1e-6 / d for d in degrees), lin=tuple(1e-3 / d for d in degrees),
                       capacity=tuple(float(per_gpu * d) for d in degrees), beta1=0.1)


# --------------------------------------------------------------------- upstream's plans (the fixture)

def fixture_cases():
    for path in sorted(FIXTURE.glob("*.json")):
        data = json.loads(path.read_text())
        for batch in data["batches"]:
            yield pytest.param(data["setting"], batch, id=f"{path.stem}-{batch['seed']}")


def setting_costs(setting: dict) -> tuple[flexsp.CostModel, DegreeCosts]:
    cost = flexsp.cost_from_preset(setting["model_preset"], context=setting["context"],
                                        num_gpus=setting["num_gpus"])
    cluster = flexsp.Cluster(setting["num_gpus"], setting["gpus_per_node"])
    assert cost.token_capacity == setting["max_seq_len_per_rank"]   # P of the upstream runs
    return cost, cost.degree_costs(cluster.degrees)


def upstream_schedule(plan: list) -> Schedule:
    return Schedule(tuple(tuple(GroupAssignment(g["size"], np.asarray(g["seq_ids"], dtype=np.int64)) for g in mb)
                          for mb in plan))


@pytest.mark.parametrize("setting, batch", list(fixture_cases()))
def test_as_fast_as_upstream_on_its_own_plans(setting, batch):
    """The issue's bar: per batch no slower than upstream's plan (1%), group sizes agree on >= 99.5%."""
    _, costs = setting_costs(setting)
    lengths = np.asarray(batch["lengths"], dtype=np.int64)
    ours = dynamic_cp(lengths, costs, setting["num_gpus"])
    theirs = upstream_schedule(batch["plan"])
    assert sorted(np.concatenate([g.seq_ids for mb in theirs.micro_batches for g in mb])) == list(range(len(lengths)))
    assert ours.time(lengths, costs) <= theirs.time(lengths, costs) * 1.01
    agree = np.mean(ours.degree_of_sequences(len(lengths)) == theirs.degree_of_sequences(len(lengths)))
    assert agree >= 0.995
    assert len(ours.micro_batches) <= len(theirs.micro_batches)
    # in fact the stand-in reproduces upstream's plan exactly: same micro-batches, same groups in rank order
    assert shape(ours) == [[(g["size"], g["seq_ids"]) for g in mb] for mb in batch["plan"]]


def test_fixture_batches_are_the_bundled_wikipedia_draws():
    """Provenance: the fixture's lengths are the README's draws from the bundled Wikipedia lengths."""
    lengths = get_distribution("wikipedia").lengths
    for path in sorted(FIXTURE.glob("*.json")):
        data = json.loads(path.read_text())
        pool = lengths[lengths <= data["setting"]["context"]]
        assert pool.size == data["sampling"]["pool_size"]
        for batch in data["batches"]:
            draw = pool[np.random.default_rng(batch["seed"]).integers(0, pool.size, size=len(batch["lengths"]))]
            assert draw.tolist() == batch["lengths"]


def test_the_transcribed_rule_reproduces_the_fixture():
    """The reference below is itself checked against upstream's output, so agreeing with it elsewhere
    (other P, other lengths, other clusters) means agreeing with upstream's rule."""
    for path in sorted(FIXTURE.glob("*.json")):
        data = json.loads(path.read_text())
        per_rank = data["setting"]["max_seq_len_per_rank"]
        for batch in data["batches"][:2]:
            plan = upstream_rule(batch["lengths"], 64, lambda s: megatron_group_size(s, per_rank), lambda d: d * per_rank)
            assert plan == [[(g["size"], g["seq_ids"]) for g in mb] for mb in batch["plan"]]


# ---------------------------------------------------------------------- the rule, step by step, by hand

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
    with pytest.raises(ValueError, match="lookahead"):
        dynamic_cp(np.array([10]), toy_costs(8), 8, lookahead="some")


def test_five_percent_stop_waits_for_a_smaller_size():
    # every sequence takes 1 GPU, so the stop is never tested: 2500 vs 2401 would pass it, but the
    # short ones still join the less loaded GPU (bucket [50, 49, 5] then [5]); one micro-batch
    assert shape(dynamic_cp(np.array([50, 49, 5, 5]), toy_costs(2), 2)) == [[(1, [0]), (1, [1, 2, 3])]]


def test_five_percent_stop_after_a_smaller_size():
    # 140 takes 2 GPUs; 100 and 99 take one each: loads 9800, 10000, 9801 are within 5%, and 99 is
    # smaller than the first size, so the micro-batch closes with three sequences left; in the next one
    # 60, 50 and 10 open one GPU each and the idle GPU doubles the first group
    schedule = dynamic_cp(np.array([140, 100, 99, 60, 50, 10]), toy_costs(2), 4)
    assert shape(schedule) == [[(2, [0]), (1, [1]), (1, [2])], [(2, [3]), (1, [4]), (1, [5])]]


def test_trim_overload_requeues_the_last_sequence_of_the_most_loaded_group():
    # 57 joins the least loaded GPU (58^2) and overloads it (6613 vs 3600); taking it off narrows the
    # spread, so it waits for the next micro-batch, alone (and doubled onto 2 of the 3 GPUs)
    schedule = dynamic_cp(np.array([60, 59, 58, 57]), big_costs(2), 3)
    assert shape(schedule) == [[(1, [0]), (1, [1]), (1, [2])], [(2, [3])]]


def test_only_the_first_sequence_of_each_bucket_is_looked_at():
    # buckets [100, 95, 90, 4] and [1]: 90 has no room, which blocks its bucket (4 would fit), 1 goes;
    # the former deferral ("all") keeps scanning and places 4 as well
    lengths = np.array([100, 95, 90, 4, 1])
    assert shape(dynamic_cp(lengths, toy_costs(2), 2)) == [[(1, [0]), (1, [1, 4])], [(1, [2]), (1, [3])]]
    assert shape(dynamic_cp(lengths, toy_costs(2), 2, lookahead="all")) == [[(1, [0]), (1, [1, 3, 4])], [(2, [2])]]


def test_sequence_too_big_for_the_free_gpus_waits():
    # 3 GPUs: 180 takes a 2-GPU group; 170 needs 2 more GPUs or room in that group: its bucket waits,
    # 90 goes; 20 would join 90's GPU but only 10 tokens are left there
    schedule = dynamic_cp(np.array([180, 170, 90, 20]), toy_costs(2), 3)
    assert shape(schedule) == [[(2, [0]), (1, [2])], [(2, [1]), (1, [3])]]


def test_empty_gpus_double_the_smallest_groups_earliest_first():
    # 8 GPUs: 150 -> 2 GPUs, 80 -> 1, 70 -> 1; 4 left: the 1s double (2 left), then the first 2 doubles
    assert shape(dynamic_cp(np.array([150, 80, 70]), toy_costs(8), 8)) == [[(4, [0]), (2, [1]), (2, [2])]]
    # two groups on 8 GPUs: 1 -> 2, then 2 and 2 -> 4 and 4
    assert shape(dynamic_cp(np.array([150, 80]), toy_costs(8), 8)) == [[(4, [0]), (4, [1])]]
    # 6 GPUs: a 4-GPU group cannot grow to 8, two GPUs stay idle
    assert shape(dynamic_cp(np.array([300]), toy_costs(4), 6)) == [[(4, [0])]]


def test_deterministic():
    lengths = np.random.default_rng(3).integers(1, 800, 200)
    assert shape(dynamic_cp(lengths, toy_costs(8), 8)) == shape(dynamic_cp(lengths, toy_costs(8), 8))


# ------------------------------------------------------------ the reference on random batches and P

@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), st.lists(st.integers(1, 1600), min_size=1, max_size=40),
       st.sampled_from([0.0, 0.05, 0.3]), st.sampled_from([None, 25, 60, 150]))
def test_matches_upstream_rule_transcribed(num_gpus, lengths, tolerance, per_rank):
    costs = toy_costs(16)
    top = max(d for d in costs.degrees if d <= num_gpus)
    lengths = [min(s, PER_GPU * top) for s in lengths]
    size_of, cap_of = capped_sizes(costs, num_gpus, per_rank or PER_GPU)
    assert shape(dynamic_cp(np.array(lengths), costs, num_gpus, max_seqlen_per_rank=per_rank, tolerance=tolerance)) \
        == upstream_rule(lengths, num_gpus, size_of, cap_of, tolerance)


@pytest.mark.parametrize("dataset", ["wikipedia", "github", "commoncrawl"])
@pytest.mark.parametrize("per_rank", [512, 2048])
def test_never_more_micro_batches_than_upstream_for_smaller_per_rank(dataset, per_rank):
    """Below one GPU's capacity the stand-in caps a group at its memory, upstream's runs cap it at
    ``size * max_seqlen_per_rank``: the stand-in packs at least as much. Compared where upstream
    itself can run (no sequence asks for more than 64 GPUs)."""
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    costs = cost.degree_costs(flexsp.Cluster(64).degrees)
    size_of, memory = capped_sizes(costs, 64, per_rank)
    for seed in range(2):
        lengths, _ = preprocess(get_distribution(dataset).sample_batch(256, seed), 64 * per_rank, 64)
        ours = dynamic_cp(lengths, costs, 64, max_seqlen_per_rank=per_rank)
        # the same rule with the memory cap is the stand-in, plan for plan
        assert shape(ours) == upstream_rule(lengths.tolist(), 64, size_of, memory)
        theirs = upstream_rule(lengths.tolist(), 64, lambda s: megatron_group_size(s, per_rank),
                               lambda d: d * per_rank)
        assert len(ours.micro_batches) <= len(theirs)


@pytest.mark.parametrize("dataset", ["github", "commoncrawl"])
def test_other_length_distributions_match_upstream_at_default_per_rank(dataset):
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    costs = cost.degree_costs(flexsp.Cluster(64).degrees)
    per_rank = cost.token_capacity
    lengths, _ = preprocess(get_distribution(dataset).sample_batch(512, 5), 384 * 1024, 64)
    theirs = upstream_rule(lengths.tolist(), 64, lambda s: megatron_group_size(s, per_rank), lambda d: d * per_rank)
    assert shape(dynamic_cp(lengths, costs, 64)) == theirs


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
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    degrees = flexsp.Cluster(16384).degrees
    costs = DegreeCosts(degrees, tuple(1e-9 / d for d in degrees), tuple(1e-4 / d for d in degrees),
                        tuple(cost.token_capacity * d for d in degrees), 0.6)
    lengths = get_distribution("wikipedia").sample_batch(131072, 0)
    started = time.process_time()   # CPU seconds: a shared CI machine's load does not count
    schedule = dynamic_cp(lengths, costs, 16384)
    assert time.process_time() - started < 15
    assert schedule.num_sequences == len(lengths)


# ------------------------------------------------------------ the pending list and the deadline (issue 31)

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1600), min_size=1, max_size=300), st.data())
def test_pending_buckets_equal_make_buckets_after_removals_and_appends(lengths, data):
    """``_Pending.buckets`` (block searches) against ``make_buckets`` (upstream's scan) on the same
    pending list, as it is after micro-batches remove sequences and re-queue trimmed ones."""
    from solver.dynamic_cp import _Batch, _Pending, make_buckets
    costs = toy_costs(16)
    size = group_degrees(np.array(lengths), costs, 16).tolist()
    degrees, scale = costs.degrees, 16
    batch = _Batch(length=lengths, size=size, degrees=degrees, capacity=costs.capacity,
                   estimate=[s * s * (scale // degrees[k]) for s, k in zip(lengths, size)],
                   work=[s * s / degrees[k] for s, k in zip(lengths, size)], scale=scale)
    _Pending.BLOCK = data.draw(st.sampled_from([1, 3, 8, 512]))   # many blocks, and one
    try:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        pending, reference = _Pending(order, batch), list(order)
        for _ in range(data.draw(st.integers(0, 4))):
            slots, t = [], pending.head
            while t != _Pending.END:
                slots.append(t)
                t = pending.nxt[t]
            drop = data.draw(st.sets(st.integers(0, len(slots) - 1), max_size=len(slots) - 1))
            back = data.draw(st.lists(st.sampled_from(sorted(drop)), unique=True)) if drop else []
            for j in sorted(drop):
                pending.remove(slots[j])
            reference = [i for j, i in enumerate(reference) if j not in drop]
            for j in back:
                pending.append(order_at := pending.seq[slots[j]])
                reference.append(order_at)
        got = []
        for start, stop in pending.buckets():
            run, t = [], start
            while t != stop:
                run.append(pending.seq[t])
                t = pending.nxt[t]
            got.append(run)
        assert got == make_buckets(reference, batch)
    finally:
        _Pending.BLOCK = 512


def test_past_the_deadline_the_rest_is_still_a_valid_plan():
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    costs = cost.degree_costs(flexsp.Cluster(64).degrees)
    lengths, _ = preprocess(get_distribution("wikipedia").sample_batch(3000, 0), 384 * 1024, 64)
    full = dynamic_cp(lengths, costs, 64)
    for deadline in (0.0, None):
        schedule = dynamic_cp(lengths, costs, 64, deadline=deadline)
        ids = np.concatenate([g.seq_ids for mb in schedule.micro_batches for g in mb])
        assert sorted(ids.tolist()) == list(range(len(lengths)))
        for mb in schedule.micro_batches:
            assert sum(g.degree for g in mb) <= 64
            for g in mb:
                assert lengths[g.seq_ids].sum() <= costs.capacity[costs.index(g.degree)]
                assert all(megatron_group_size(s, costs.capacity[0]) <= g.degree for s in lengths[g.seq_ids])
    assert shape(schedule) == shape(full)


def test_200000_sequences_are_planned_within_the_time_limit():
    """The issue's case (64 GPUs, gpt-7b, limit 2 s): today 200,000 sequences took 37-54 s. The
    deadline bounds the rule itself; what plan_batch adds (ranks, validation) is linear. Timed as min(wall,
    this process's CPU seconds), with tests/solver/test_time_limits.py's generous margin: a loaded CI machine
    stretches both (5.2 s of CPU at load 10 on 2 cores, against a 1 s margin that used to be the limit here),
    ignoring the limit costs 37-54 s."""
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    lengths, _ = preprocess(get_distribution("wikipedia").sample_batch(200_000, 1), 384 * 1024, 64)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(64, 8), "dynamic-cp", time_limit=2.0)
    elapsed = min(time.perf_counter() - wall, time.process_time() - cpu)
    assert sum(len(g.seq_ids) for mb in plan.micro_batches for g in mb.groups) == len(lengths)
    assert elapsed < 2.0 + 8.0, f"{elapsed:.1f} s (load {__import__('os').getloadavg()[0]:.1f})"
