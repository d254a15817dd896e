import dataclasses
import json

import pytest

import flexsp
from flexsp import Group, MicroBatch, Plan
from flexsp.plan.types import PlacedGroups

COST = flexsp.CostModel(alpha1=1e-9, alpha2=1e-4, beta1=0.1, comm_bytes_per_token=1e6,
                        alltoall_bandwidth={2: 1e11, 4: 1e11, 8: 1e11, 16: 1e10}, token_capacity=1000)
CLUSTER = flexsp.Cluster(16, 8)
LENGTHS = [900, 1500, 300, 200]


def plan_of(*micro_batches, lengths=LENGTHS, predicted=None) -> Plan:
    mbs = tuple(MicroBatch(tuple(Group(tuple(r), tuple(s)) for r, s in mb)) for mb in micro_batches)
    plan = Plan(num_gpus=16, micro_batches=mbs, predicted_time=0.0)
    if predicted is None:
        predicted = plan.time(lengths, COST)
    return Plan(num_gpus=16, micro_batches=mbs, predicted_time=predicted)


GOOD = [[(range(0, 2), (1,)), (range(2, 3), (0,)), (range(3, 4), (2, 3))]]


def test_a_good_plan_validates_and_round_trips():
    plan = plan_of(*GOOD)
    plan.validate(LENGTHS, COST, CLUSTER)
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    assert again.degree_histogram() == {1: 2, 2: 1}


@pytest.mark.parametrize("where, key", [((), "gpus_per_nodes"), (("micro_batches", 0), "meta"),
                                        (("micro_batches", 0, "groups", 0), "rings")])
def test_a_plan_file_key_the_format_lacks_is_refused(where, key):
    """A plan file is untrusted: a typo (``"rings": 2``) dropped silently would run a ring group as Ulysses."""
    data = plan_of(*GOOD).to_dict()
    node = data
    for step in where:
        node = node[step]
    node[key] = 2
    with pytest.raises(flexsp.PlanError, match=rf"unknown keys \['{key}'\] \(a typo\?\)"):
        Plan.from_dict(data)


@pytest.mark.parametrize("micro_batches, message", [
    ([[(range(1, 4), (0, 1, 2, 3))]], "not a tile of degree 3"),
    ([[(range(0, 2), (1,)), (range(1, 2), (0, 2, 3))]], "rank 1 is used by two groups"),
    ([[(range(1, 3), (1,)), (range(0, 1), (0, 2, 3))]], "not a tile of degree 2"),
    ([[(range(16, 17), (0, 1, 2, 3))]], "rank 16 is outside 0..15"),
    ([[(range(0, 2), (1,)), (range(2, 3), (0,))]], r"sequences \[2, 3\] are not planned"),
    ([[(range(0, 2), (1, 0)), (range(2, 3), (0,)), (range(3, 4), (2, 3))]], "sequence 0 is planned twice"),
    ([[(range(0, 2), (1, 0)), (range(2, 3), (2, 3))]], "2400 tokens overflow 2 GPUs"),
    ([[(range(0, 2), (1,)), (range(2, 3), (0,)), (range(3, 4), (2, 3, 7))]], r"sequence ids \[7\] do not exist"),
    ([[(range(0, 2), (1,)), (range(2, 3), (0,)), (range(3, 4), ())]], "group has no sequences"),
])
@pytest.mark.parametrize("form", ["tuples", "columns"])
def test_each_broken_rule_is_named(micro_batches, message, form):
    plan = plan_of(*micro_batches, predicted=1.0)
    with pytest.raises(flexsp.PlanError, match=message):
        (plan if form == "tuples" else as_columns(plan)).validate(LENGTHS, COST, CLUSTER)


def as_columns(plan: Plan) -> Plan:
    """``plan`` with every micro-batch's groups as ``PlacedGroups`` (what ``plan_batch`` returns); contiguous ranks."""
    def columns(groups):
        return PlacedGroups([g.ranks[0] for g in groups], [g.degree for g in groups], [g.ring for g in groups],
                            [s for g in groups for s in g.seq_ids], [len(g.seq_ids) for g in groups])
    return dataclasses.replace(plan, micro_batches=tuple(MicroBatch(columns(mb.groups)) for mb in plan.micro_batches))


def test_columns_read_compare_and_pickle_as_their_groups():
    import pickle
    plan = plan_of(*GOOD)
    columns = as_columns(plan)
    assert columns == plan and plan == columns and hash(columns) == hash(plan)
    assert columns.to_dict() == plan.to_dict() and columns.degree_histogram() == plan.degree_histogram() == {1: 2, 2: 1}
    assert columns.num_sequences == 4 and columns.micro_batches[0].groups[2] == Group((3,), (2, 3))
    assert columns.time(LENGTHS, COST) == plan.time(LENGTHS, COST)
    columns.validate(LENGTHS, COST, CLUSTER)
    back = pickle.loads(pickle.dumps(columns))
    assert back == plan and isinstance(back.micro_batches[0].groups, tuple)


def test_node_crossing_and_wrong_prediction_and_cluster_size():
    crossing = plan_of([(range(6, 10), (0, 1, 2, 3))], predicted=1.0)   # 4 GPUs across nodes 0 and 1
    with pytest.raises(flexsp.PlanError, match="span nodes"):
        crossing.validate(cluster=CLUSTER, aligned=False)
    with pytest.raises(flexsp.PlanError, match="predicted_time 123.0 does not match"):
        plan_of(*GOOD, predicted=123.0).validate(LENGTHS, COST, CLUSTER)
    with pytest.raises(flexsp.PlanError, match="plan is for 16 GPUs but the cluster has 8"):
        plan_of(*GOOD).validate(LENGTHS, COST, flexsp.Cluster(8))


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[]", "must be a JSON object"),
    ('{"num_gpus": 4, "predicted_time": 1}', "missing 'micro_batches'"),
    ('{"num_gpus": "4", "predicted_time": 1, "micro_batches": []}', "num_gpus must be an integer"),
    ('{"num_gpus": 4, "predicted_time": 1, "micro_batches": [{"groups": [{"ranks": [0]}]}]}', "'ranks' and 'seq_ids'"),
    ('{"num_gpus": 4, "predicted_time": 1, "micro_batches": [{"groups": [{"ranks": [0.5], "seq_ids": [0]}]}]}', "must hold integers"),
])
def test_corrupt_plan_files_are_named(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(flexsp.PlanError, match=message):
        Plan.load(path)


def test_contract_keys():
    data = json.loads(plan_of(*GOOD).to_json())
    assert {"num_gpus", "predicted_time", "micro_batches"} <= set(data)
    assert set(data["micro_batches"][0]["groups"][0]) == {"ranks", "seq_ids"}


def test_a_ring_that_does_not_divide_its_group_is_named_in_columns_too():
    groups = (Group((0, 1, 2, 3), (0, 1, 2, 3), ring=3),)
    plan = Plan(num_gpus=16, micro_batches=(MicroBatch(groups),), predicted_time=1.0)
    for form in (plan, as_columns(plan)):
        with pytest.raises(flexsp.PlanError, match="micro-batch 0 group 0: ring degree 3 must be a whole number"):
            form.validate(LENGTHS, COST, CLUSTER)
