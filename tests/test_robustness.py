"""Every hostile input of issue 21 (cost models, plan files, plan_batch arguments, validate, the CLI)
gives a flexsp error naming the problem; communicator memory comes off the planning capacity."""
import json
import math

import numpy as np
import pytest
from validator import check_plan

import flexsp
from flexsp import Cluster, CostModel, Group, MicroBatch, Plan, plan_batch
from flexsp.cli import main
from flexsp.errors import CostModelError, FlexSPError, PlanError
from flexsp.plan.analytic import cost_from_hardware
from flexsp.plan.communicator_memory import (
    COMMUNICATOR_BYTES,
    communicators_per_rank,
    pool_degrees,
    reserve_communicators,
)
from flexsp.plan.presets import cost_from_preset

PRESET = cost_from_preset("gpt-7b")
BASE = PRESET.to_dict()
CLUSTER = Cluster(64, 8)
LENGTHS = [1000, 20_000, 300_000, 5000]


def cost_with(**change) -> CostModel:
    return CostModel.from_dict({**BASE, **change})


# --- cost models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"alpha1": 1e300}, r"would take 4.1e\+307 s, above 1e\+150 s.*units"),
    ({"token_capacity": 1e308}, r"token_capacity 1e\+308 is above 2\*\*52"),
    ({"alpha1": 5e-324, "alpha2": 0.0, "comm_bytes_per_token": 0.0}, "vanishes beside beta1"),
    ({"beta1": 1e6, "alpha1": 1e-24, "alpha2": 1e-18, "comm_bytes_per_token": 0.0}, "vanishes beside beta1"),
    ({"token_capacity": 0.5}, "token_capacity must be >= 1"),
    ({"alltoall_bandwidth": {"2": "fast"}}, r"alltoall_bandwidth\[2\] must be a number, got 'fast'"),
    ({"alltoall_bandwidth": {"two": 1e9}}, "keys must be integer SP degrees, got 'two'"),
    ({"alltoall_bandwidth": {"0": 1e9}}, "degree 0, which is not an SP degree"),
    ({"alltoall_bandwidth": {str(d): 1e9 for d in range(1, 2**16 + 2)}}, "more than the 65536 a cost model may list"),
    ({"alltoall_bandwidth": [1e9]}, "alltoall_bandwidth must be an object"),
    ({"meta": [1, 2]}, "meta must be a mapping"),
    ({"meta": "gpt"}, "meta must be a mapping"),
    ({"heads": 8, "ring_bandwidth": "5e9"}, r"ring_bandwidth \(bytes/s, or None\) must be a number, got '5e9'"),
    ({"heads": 8, "ring_bandwidth": 5e9, "ring_bytes_per_token": "1"}, "ring_bytes_per_token must be a number"),
    ({"heads": 32.0}, "heads .* must be an integer"),
    ({"alpha1": 10**400}, "alpha1 = 1000.* is too large for a float"),
    ({"token_capacity": 10**400}, "token_capacity = 1000.* is too large for a float"),
    ({"alpha2": float("nan")}, "alpha2 must be finite"),
    ({"beta1": True}, "beta1 must be a number, got True"),
    ({"alpah1": 1.0}, r"unknown keys \['alpah1'\] \(a typo\?\)"),
])
def test_bad_cost_models_are_named(change, message):
    with pytest.raises(CostModelError, match=message):
        cost_with(**change)


def test_a_ring_model_checks_the_range_at_every_degree_it_is_asked_for():
    ring = cost_from_hardware("llama-7b", "h100-80gb", num_gpus=64)   # degrees above 32 need no bandwidth
    with pytest.raises(CostModelError, match=r"above 2\*\*52"):
        ring.degree_costs([1, 2**52])


@pytest.mark.parametrize("call, message", [
    (lambda: cost_from_preset(None), r"unknown preset None; choose one of \['gemma-3-27b', 'gpt-13b'"),
    (lambda: cost_from_preset("gpt-7b", context="384K"), r"context \(tokens.*must be an integer, got '384K'"),
    (lambda: cost_from_preset("gpt-7b", num_gpus=0), "num_gpus must be >= 1"),
    (lambda: cost_from_hardware("llama-7b", "h100-80gb", num_gpus=0), "num_gpus must be >= 1, got 0"),
    (lambda: cost_from_hardware("llama-7b", "h100-80gb", num_gpus=-4), "num_gpus must be >= 1, got -4"),
    (lambda: cost_from_hardware(None, "h100-80gb", num_gpus=8), "model must be a registered name .*llama-7b.* or a ModelSpec, got None"),
    (lambda: cost_from_hardware("llama-7b", "h100-80gb", num_gpus=8, zero=3), r"unknown options \['zero'\]"),
])
def test_bad_constructor_arguments_are_named(call, message):
    with pytest.raises(CostModelError, match=message):
        call()


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"alpha1": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"{", "not valid JSON"),
])
def test_bad_cost_files_are_named(tmp_path, content, message):
    path = tmp_path / "cost.json"
    path.write_bytes(content)
    with pytest.raises(CostModelError, match=message):
        CostModel.load(path)
    with pytest.raises(CostModelError, match="cannot read cost model"):
        CostModel.load(tmp_path / "missing.json")


def test_capacity_is_an_integer_and_compared_exactly():
    cost = cost_with(token_capacity=2**52, alltoall_bandwidth={}, alpha1=1e-30)
    assert cost.group_capacity(1) == 2**52 and isinstance(cost.group_capacity(1), int)
    assert cost.fits([2**52], 1) and not cost.fits([2**52, 1], 1) and not cost.fits([2**62, 2**62], 1)
    assert cost.min_degree(2**52) == 1
    with pytest.raises(PlanError, match="more than the whole cluster can hold"):
        plan_batch([2**52 + 1], cost, Cluster(1))        # compared as integers, not floats
    plan = plan_batch([2**52], cost, Cluster(1))
    assert plan.num_sequences == 1


# --- plan files ----------------------------------------------------------------------------------
GOOD = plan_batch(LENGTHS, PRESET, CLUSTER).to_dict()


def plan_with(edit) -> dict:
    data = json.loads(json.dumps(GOOD))
    edit(data)
    return data


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(solve_time="x"), r"solve_time \(seconds\) must be a number"),
    (lambda d: d.update(predicted_time=10**400), "predicted_time .* too large for a float"),
    (lambda d: d.update(predicted_time=float("inf")), "predicted_time .* must be finite"),
    (lambda d: d.update(strategy=5), "strategy must be a string"),
    (lambda d: d["micro_batches"][0]["groups"][0]["ranks"].__setitem__(0, 2**64), "ranks must hold integers from 0"),
    (lambda d: d["micro_batches"][0]["groups"][0]["seq_ids"].__setitem__(0, 2**64), "seq_ids must hold integers"),
    (lambda d: d["micro_batches"][0]["groups"][0].update(ring=2.0), "ring must be an integer"),
])
def test_corrupt_plans_are_named(edit, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(plan_with(edit))


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"num_gpus": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_corrupt_plan_files_are_named(tmp_path, content, message):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_validate_names_bad_values_built_in_python():
    empty = Plan(64, (MicroBatch((Group(tuple(range(64)), (0, 1, 2, 3)), Group((), (9,)))),), 1.0)
    with pytest.raises(PlanError, match="group 1: group has no ranks"):
        empty.validate()
    huge = Plan(64, (MicroBatch((Group((2**64,), (0,)),)),), 1.0)
    with pytest.raises(PlanError, match="ranks must hold integers in int64's range"):
        huge.validate()
    with pytest.raises(PlanError, match="num_gpus must be an integer"):
        Plan(64.0, (MicroBatch((Group((0,), (0,)),)),), 1.0).validate()


# --- validate(): head limit and exact token sums -------------------------------------------------
def test_validate_checks_the_ulysses_head_limit_and_split():
    llama = cost_from_hardware("llama-7b", "h100-80gb", num_gpus=64)     # 32 heads: Ulysses at most 32
    plan = plan_batch([500_000], llama, CLUSTER)
    group = plan.micro_batches[0].groups[0]
    assert (group.degree, group.ring, group.ulysses) == (64, 2, 32)
    plan.validate([500_000], llama, CLUSTER)
    stripped = Plan.from_dict(json.loads(plan.to_json().replace(',"ring":2', "")))
    assert stripped.micro_batches[0].groups[0].ring == 1
    stripped.validate([500_000], cluster=CLUSTER)                 # without the model, heads are unknown
    with pytest.raises(PlanError, match="Ulysses degree 64 .* does not divide the model's 32 attention heads"):
        stripped.validate([500_000], llama, CLUSTER)
    too_much_ring = Plan(64, (MicroBatch((Group(tuple(range(64)), (0,), ring=4),)),), plan.predicted_time)
    with pytest.raises(PlanError, match="runs Ulysses 16 x ring 4, but the cost model costs 64 GPUs as Ulysses 32 x ring 2"):
        too_much_ring.validate([500_000], llama, CLUSTER)
    odd = Plan(64, (MicroBatch((Group(tuple(range(64)), (0,), ring=3),)),), plan.predicted_time)
    with pytest.raises(PlanError, match="ring degree 3 must be a whole number dividing"):
        odd.validate([500_000], llama, CLUSTER)


def test_validate_sums_tokens_without_int64_overflow():
    cost = cost_with(token_capacity=1000, alltoall_bandwidth={})
    plan = Plan(1, (MicroBatch((Group((0,), (0, 1)),)),), 1.0)
    assert int(np.array([2**62, 2**62], dtype=np.int64).sum()) < 0            # what int64 would have said
    with pytest.raises(PlanError, match=f"{2**63} tokens overflow 1 GPUs"):
        plan.validate([2**62, 2**62], cost, Cluster(1))


# --- plan_batch arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "static", "sp_degree": 8.0}, "sp_degree must be an integer, got 8.0"),
    ({"strategy": "static", "sp_degree": 12}, "12 GPUs: not inside a node of 8 nor whole nodes"),
    ({"sp_degree": 8}, "sp_degree=8 is used only by strategy='static'"),
    ({"degrees": ("a",)}, "each of degrees must be an integer, got 'a'"),
    ({"degrees": 8}, r"degrees must be \"any\" or a collection of SP degrees, e.g. degrees=\(1, 8, 64\) .*; got 8"),
    ({"degrees": "18"}, "degrees must be .*a collection .* got '18'"),
    ({"degrees": (2.5,)}, "each of degrees must be an integer, got 2.5"),
    ({"degrees": ()}, "degrees is empty"),
    ({"degrees": (128,)}, r"degrees not usable on 64 GPUs in nodes of 8: 128 GPUs: more than the cluster's 64"),
    ({"degrees": (1, 7, 12)}, r"12 GPUs: not inside a node of 8 nor whole nodes"),
    ({"time_limit": None}, r"time_limit \(seconds\) must be a number, got None"),
    ({"time_limit": float("nan")}, r"time_limit \(seconds\) must be finite"),
    ({"time_limit": 0}, r"time_limit \(seconds\) must be > 0"),
    ({"time_limit": True}, "time_limit .* must be a number, got True"),
    ({"num_buckets": 0}, "num_buckets must be >= 1, got 0"),
    ({"num_buckets": 2.0}, "num_buckets must be an integer"),
    ({"max_degree": 0, "ulysses_only": True}, r"max_degree .* must be >= 1, got 0"),
    ({"ulysses_only": "yes"}, "ulysses_only must be True or False"),
    ({"strategy": None}, "unknown strategy None"),
])
def test_bad_plan_batch_arguments_are_named(kwargs, message):
    with pytest.raises(PlanError, match=message):
        plan_batch(LENGTHS, PRESET, CLUSTER, **kwargs)


def test_good_arguments_still_plan():
    plan = plan_batch(LENGTHS, PRESET, CLUSTER, degrees=np.array([1, 8, 64]), num_buckets=np.int64(4),
                      time_limit=1, max_degree=64)
    check_plan(plan.to_dict(), LENGTHS, PRESET, 64, 8)
    assert set(plan.degree_histogram()) <= {1, 8, 64}


# --- the command line ----------------------------------------------------------------------------
def cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:       # argparse's own errors: usage, then one error line, exit 2
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["plan", "{lengths}", "-o", "{tmp}/missing/plan.json"], "flexsp plan: error: cannot write -o/--output .*does not exist"),
    (["plan", "{lengths}", "-o", "{tmp}"], "flexsp plan: error: -o/--output .* is a folder"),
    (["simulate", "--json", "{tmp}/missing/out.json"], "flexsp simulate: error: cannot write --json"),
    (["simulate", "--gantt", "{tmp}/missing/g.png"], "flexsp simulate: error: cannot write --gantt"),
    (["simulate", "--cost", "{bad}"], "flexsp simulate: error: cost model .* is not UTF-8 text"),
    (["plan", "{lengths}", "--cost", "{bad}"], "flexsp plan: error: cost model .* is not UTF-8 text"),
    (["simulate", "--seed", "-1"], "flexsp simulate: error: argument --seed: must be >= 0, got -1"),
    (["simulate", "--strategies", ","], "flexsp simulate: error: --strategies ',' names no strategy"),
    (["simulate", "--strategies", "flexsp,flexpp"], "flexsp simulate: error: --strategies: unknown strategy 'flexpp'"),
    (["simulate", "--context", "1.5"], "flexsp simulate: error: argument --context: expected a whole token count"),
    (["simulate", "--time-limit", "nan"], "flexsp simulate: error: argument --time-limit: expected seconds > 0"),
    (["plan", "{lengths}", "--communicator-memory", "-5"], "argument --communicator-memory: MiB per communicator"),
])
def test_cli_prints_one_error_line_and_exits_nonzero_before_solving(tmp_path, capsys, monkeypatch, argv, message):
    import flexsp.plan.strategies
    monkeypatch.setattr(flexsp.plan.strategies, "run_strategy", lambda *a, **k: pytest.fail("solved before the error"))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n20000\n")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    argv = [a.format(tmp=tmp_path, lengths=lengths, bad=bad) for a in argv] + (["--quiet"] if argv[0] == "simulate" else [])
    code, out, err = cli(capsys, *argv)
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert __import__("re").search(message, errors[0]), errors[0]


def test_cli_plan_reserves_communicator_memory(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n20000\n5000\n")
    code, out, err = cli(capsys, "plan", str(lengths), "-o", str(tmp_path / "p.json"), "--communicator-memory")
    assert code == 0, err
    assert "6 communicators per rank x 512 MiB = 3.00 GiB reserved: token capacity 6407 -> 5721 per GPU" in out
    assert Plan.load(tmp_path / "p.json").num_sequences == 3


# --- communicator memory -------------------------------------------------------------------------
def test_communicators_come_off_the_planning_capacity():
    assert communicators_per_rank([1, 2, 4, 8, 16, 32, 64]) == 6 and communicators_per_rank([1]) == 0
    assert pool_degrees(CLUSTER, "flexsp", (1, 8, 64)) == (1, 8, 64)
    assert pool_degrees(CLUSTER, "static", sp_degree=32) == (32,) and pool_degrees(CLUSTER, "static") == (64,)
    # gpt-7b: 4.480441895 MB of activations per token (the paper), 512 MiB per communicator
    reserved = reserve_communicators(PRESET, CLUSTER.degrees)
    per_token = 4.480441895 * 2**20
    assert reserved.token_capacity == math.floor(6407 - 6 * COMMUNICATOR_BYTES / per_token) == 5721
    assert reserved.meta["communicators"] == {"count": 6, "bytes_each": COMMUNICATOR_BYTES,
                                              "tokens": math.ceil(6 * COMMUNICATOR_BYTES / per_token),
                                              "capacity_before": 6407}
    again = reserve_communicators(reserved, (1, 8, 64), 256 * 2**20)     # replaces, never stacks
    per_token_7b = per_token
    assert again.token_capacity == math.floor(6407 - 2 * 256 * 2**20 / per_token)
    assert CostModel.from_dict(json.loads(json.dumps(again.to_dict()))) == again
    analytic = cost_from_hardware("llama-7b", "a100-40gb", num_gpus=64)
    per_token = analytic.activation_bytes_per_token     # the capacity model's measured-layer figure
    assert reserve_communicators(analytic, (1, 2)).token_capacity == math.floor(analytic.token_capacity - 2**29 / per_token)
    with pytest.raises(CostModelError, match="leave no activation memory"):
        reserve_communicators(PRESET, CLUSTER.degrees, 8 * 2**30)
    bare = CostModel(**{k: BASE[k] for k in ("alpha1", "alpha2", "beta1", "comm_bytes_per_token", "token_capacity")},
                     alltoall_bandwidth={})
    with pytest.raises(CostModelError, match="pass activation_bytes_per_token"):
        reserve_communicators(bare, (1, 2))
    assert reserve_communicators(bare, (1, 2), activation_bytes_per_token=2**20).token_capacity == 6407 - 512
    # meta comes from a file: a recorded capacity_before no reservation of these tokens can have left is not
    # trusted (a forged 1e9 would raise the capacity 150,000-fold), nor a string or NaN (no traceback)
    for forged in (1e9, "x", float("nan"), None, True):
        data = again.to_dict()
        data["meta"]["communicators"]["capacity_before"] = forged
        edited = CostModel.from_dict(data)
        assert reserve_communicators(edited, (1, 8, 64)).token_capacity == \
            math.floor(again.token_capacity - 2 * COMMUNICATOR_BYTES / per_token_7b)


def test_simulate_plans_each_strategy_with_its_pools_capacity():
    from flexsp.evaluation.simulate import format_communicator_memory, simulate
    from flexsp.plan.lengths import get_distribution
    sim = simulate(get_distribution("wikipedia"), PRESET, CLUSTER, ["flexsp[1,8,64]", "static:64"], steps=1,
                   batch_size=32, config=flexsp.PlanConfig(time_limit=0.5), progress=False, communicator_bytes=COMMUNICATOR_BYTES)
    text = format_communicator_memory(sim)
    assert "flexsp[1,8,64]: 2 communicators per rank x 512 MiB = 1.00 GiB reserved: token capacity 6407 -> 6178" in text
    assert "static:64: 1 communicator per rank x 512 MiB = 0.50 GiB reserved: token capacity 6407 -> 6292" in text
    run = sim.runs["flexsp[1,8,64]"]
    run.first_plan.validate(sim.first_batch, run.cost, CLUSTER)            # planned within the smaller capacity
    assert sim.to_dict()["strategies"]["static:64"]["token_capacity"] == 6292
    plain = simulate(get_distribution("wikipedia"), PRESET, CLUSTER, ["flexsp"], steps=1, batch_size=8,
                     config=flexsp.PlanConfig(time_limit=0.5), progress=False)
    assert plain.runs["flexsp"].cost is PRESET and "not subtracted" in format_communicator_memory(plain)


def test_every_error_is_a_flexsp_error():
    assert issubclass(CostModelError, FlexSPError) and issubclass(PlanError, FlexSPError)
    assert issubclass(flexsp.LengthsError, FlexSPError)
