"""A profile carries its model shape; planning another model with it is caught. JSON round trip is exact."""
import json
import warnings

import numpy as np
import pytest

import flexsp
from flexsp import CostModel, CostModelError
from flexsp.plan.analytic import analytic_cost_model
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.specs import MODELS, SHAPE_FIELDS
from flexsp.profile import ShapeWarning, assemble_cost_model, check_model_shape, comm_bytes_per_token, model_spec
from flexsp.profile.fit import fit_bandwidth, fit_compute


def _profiled(spec=None):
    spec = spec or model_spec("tiny")
    lengths = [128, 256, 512, 1024, 2048]
    compute = fit_compute(lengths, [2e-7 * s * s + 5e-5 * s + 5e-3 for s in lengths])
    sizes = [2**16, 2**18, 2**20]
    bws = [fit_bandwidth(d, sizes, [1e-5 + b / bw for b in sizes]) for d, bw in ((2, 40e9), (4, 30e9))]
    return assemble_cost_model(spec, compute, 4096, bandwidths=bws, bytes_per_element=2, gpus_per_node=2,
                               memory={"bytes_per_token": 1234.5, "estimate": True},
                               environment={"device": "test", "torch": "none"}, estimates=["activation memory"])


def test_json_round_trip_is_exact(tmp_path):
    cost = _profiled()
    path = tmp_path / "cost.json"
    cost.save(path)
    loaded = CostModel.load(path)
    assert loaded == cost
    assert loaded.to_dict() == cost.to_dict()            # meta included, floats bit-exact through JSON
    assert json.loads(path.read_text())["meta"]["model"]["hidden"] == 128
    meta = loaded.meta
    for key in ("source", "date", "device", "torch", "model", "estimates", "compute", "memory", "comm"):
        assert key in meta
    assert meta["comm"]["links"] == {"2": "intra-node", "4": "inter-node"}


def test_profile_is_accepted_by_the_planner_and_the_cli(tmp_path):
    cost = _profiled()
    lengths = np.array([100, 900, 3000, 5000, 200, 50])
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(4, 2), "flexsp", time_limit=0.5)
    plan.validate(lengths=lengths, cost=cost)
    path, lpath = tmp_path / "cost.json", tmp_path / "lengths.txt"
    cost.save(path)
    lpath.write_text("\n".join(map(str, lengths)) + "\n")
    from flexsp.cli import main
    assert main(["plan", str(lpath), "--cost", str(path), "--gpus", "4", "--gpus-per-node", "2",
                 "--time-limit", "0.5", "-o", str(tmp_path / "plan.json")]) == 0


def test_comm_bytes_per_token_matches_the_analytic_model():
    spec = MODELS["llama3-8b"]
    assert comm_bytes_per_token(spec, 2) == analytic_cost_model(spec, "h100-80gb", 8).comm_bytes_per_token


def test_same_shape_passes_and_other_shape_fails():
    cost = _profiled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model_shape(cost, model_spec("tiny"))
        check_model_shape(analytic_cost_model("llama-7b", "a100-80gb", 8), MODELS["llama-7b"])   # same meta layout
    other = model_spec("tiny", hidden=256, layers=4)
    with pytest.raises(CostModelError, match=r"hidden: profile 128 vs planned 256.*layers|layers: profile 2 vs planned 4"):
        check_model_shape(cost, other)
    with pytest.warns(ShapeWarning, match="hidden: profile 128 vs planned 256"):
        check_model_shape(cost, other, strict=False)


def test_cost_model_without_shape_warns():
    with pytest.warns(ShapeWarning, match="records no model shape"):
        check_model_shape(cost_from_preset("gpt-7b"), MODELS["llama-7b"])


def test_model_spec_errors_name_the_value():
    with pytest.raises(CostModelError, match="unknown model preset 'gpt-9'"):
        model_spec("gpt-9")
    with pytest.raises(CostModelError, match="needs layers"):
        model_spec(None, hidden=64)
    with pytest.raises(CostModelError, match=r"heads \(3\)"):
        model_spec("tiny", heads=3)
    assert model_spec("tiny", layers=6).layers == 6


@pytest.mark.parametrize("bad", [64.9, True, "x", None, 0])
def test_a_recorded_shape_field_is_a_whole_number_or_one_line_error(bad):
    """``meta["model"]`` comes from a file: 64.9 is not truncated to 64, true is not one layer, "x" is no traceback."""
    spec = model_spec("tiny")
    cost = CostModel(alpha1=1e-10, alpha2=1e-6, beta1=0.01, comm_bytes_per_token=1e4, alltoall_bandwidth={},
                     token_capacity=5000, meta={"model": {**spec.shape(), "hidden": bad}})
    with pytest.raises(CostModelError, match="recorded model hidden must be"):
        check_model_shape(cost, spec)
    with pytest.raises(CostModelError, match="model hidden must be|the model needs hidden"):
        model_spec(None, **{**{f: getattr(spec, f) for f in SHAPE_FIELDS}, "hidden": bad})


def test_profile_check_refuses_a_plan_over_this_cost_models_memory():
    """``flexsp profile --check PLAN``: the plan and lengths are files; a group past this cost model's capacity was
    planned for another model or GPU, and running it would allocate past the device (the replay refuses it too)."""
    from flexsp.profile.check import check_plan
    cost = cost_from_preset("gpt-7b")
    lengths = [20_000, 3_000]
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(8, 8))
    small = CostModel.from_dict({**cost.to_dict(), "token_capacity": 100})
    with pytest.raises(flexsp.PlanError, match="overflow"):
        check_plan(plan, lengths, small, runner=None, pool=None)
