"""``validate_step`` checks a plan from ``plan_batch`` (groups as ``PlacedGroups`` columns) on arrays and only the
groups they flag one by one: it must refuse exactly what the per-group loop refuses, with the same message."""
import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")

import flexsp  # noqa: E402
from flexsp import Group, MicroBatch, Plan, PlanError  # noqa: E402
from flexsp.plan.types import PlacedGroups  # noqa: E402
from flexsp.runtime.pool import GroupPool, pool_splits  # noqa: E402
from flexsp.runtime.step import validate_step  # noqa: E402

COST = flexsp.CostModel(alpha1=1e-9, alpha2=1e-4, beta1=0.1, comm_bytes_per_token=1e6,
                        alltoall_bandwidth={2: 1e11, 4: 1e11, 8: 1e11, 16: 1e10}, token_capacity=1000)


def stand_in_pool(degrees=(1, 2, 4, 8, 16), world_size=16, heads=None, closed=False) -> GroupPool:
    """A pool's bookkeeping for a world of ``world_size`` without its communicators (validate_step reads only that)."""
    pool = object.__new__(GroupPool)
    pool.world_size, pool.rank, pool.gpus_per_node, pool.degrees = world_size, 0, 8, tuple(degrees)
    pool.splits, pool.closed = pool_splits(pool.degrees, None, None, heads), closed
    return pool


def as_columns(plan: Plan) -> Plan:
    def columns(groups):
        return PlacedGroups([g.ranks[0] for g in groups], [g.degree for g in groups], [g.ring for g in groups],
                            [s for g in groups for s in g.seq_ids], [len(g.seq_ids) for g in groups])
    return dataclasses.replace(plan, micro_batches=tuple(MicroBatch(columns(mb.groups)) for mb in plan.micro_batches))


def outcome(plan: Plan, lengths, pool, **kw) -> str:
    try:
        validate_step(plan, lengths, pool, **kw)
    except PlanError as exc:
        return str(exc)
    return "ok"


LENGTHS = [900, 1500, 300, 200, 50, 50]
GOOD = Plan(16, (MicroBatch((Group((0, 1), (1,)), Group((2,), (0,)), Group((3,), (2, 3)), Group((4,), (4, 5)))),), 1.0)


@pytest.mark.parametrize("plan, pool, kw, expected", [
    (GOOD, stand_in_pool(), {"cost": COST}, "ok"),
    (GOOD, stand_in_pool(degrees=(1, 4)), {}, r"micro-batch 0 group 0: SP group on ranks \[0, 1\] is not in the pool"),
    (GOOD, stand_in_pool(closed=True), {}, "micro-batch 0 group 0: .*closed GroupPool"),
    (GOOD, stand_in_pool(), {"num_heads": 3}, "micro-batch 0 group 0: Ulysses SP degree 2 does not divide the 3"),
    (Plan(16, (MicroBatch((Group((0, 1), (1,)), Group((2,), (0, 2)), Group((3,), (3, 4, 5)))),), 1.0),
     stand_in_pool(), {"cost": COST}, "micro-batch 0 group 1 holds 1200 tokens on 1 GPUs"),
    (Plan(16, (MicroBatch((Group((0, 1), (1,)), Group((2,), (0,)), Group((3,), (2, 3, 4, 9)))),), 1.0),
     stand_in_pool(), {}, r"plan references sequence ids \[9\]"),
    (Plan(16, (MicroBatch((Group(tuple(range(4)), (0, 1, 2, 3, 4, 5), ring=2),)),), 1.0),
     stand_in_pool(heads=4), {}, r"micro-batch 0 group 0: SP group on ranks \[0, 1, 2, 3\] runs 2 x 2"),
])
def test_columns_are_refused_as_groups_are(plan, pool, kw, expected):
    got_groups, got_columns = outcome(plan, LENGTHS, pool, **kw), outcome(as_columns(plan), LENGTHS, pool, **kw)
    assert got_columns == got_groups
    assert (got_groups == "ok") if expected == "ok" else __import__("re").search(expected, got_groups)


def test_a_planned_batch_validates_and_each_rank_finds_its_group():
    lengths = np.random.default_rng(0).integers(20, 900, size=40)
    plan = flexsp.plan_batch(lengths, COST, flexsp.Cluster(16, 8))
    assert isinstance(plan.micro_batches[0].groups, PlacedGroups)
    validate_step(plan, lengths.tolist(), stand_in_pool(), cost=COST)
    parsed = Plan.from_json(plan.to_json())
    for mb, mb_parsed in zip(plan.micro_batches, parsed.micro_batches):
        for rank in range(16):
            assert mb.group_of_rank(rank) == mb_parsed.group_of_rank(rank)
