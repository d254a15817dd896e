"""The one model-state formula: its three choices, the capacities built from it, and its JSON record."""
import json
import math

import pytest

from flexsp import CostModel
from flexsp.errors import CostModelError
from flexsp.plan.analytic import analytic_cost_model
from flexsp.plan.memory import (SHARDINGS, activation_bytes_per_token, assumed, check_runtime, model_state_bytes,
                                precision_for, state_bytes)
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.specs import GPUS, ModelSpec, get_model

P = 8.03e9


def test_choices_match_the_runtime_layout():
    # fp32 master + fp32 grads + Adam moments sharded; bf16 compute copy held unless fully sharded.
    assert model_state_bytes(P, 64, "full") == pytest.approx(16 * P / 64)
    assert model_state_bytes(P, 64, "grad_optim") == pytest.approx(2 * P + 16 * P / 64)
    assert model_state_bytes(P, 64, "none") == pytest.approx(18 * P)
    s = state_bytes(P, 8, "grad_optim")
    assert (s.params, s.grads, s.optimizer, s.compute_copy) == pytest.approx((4 * P / 8, 4 * P / 8, 8 * P / 8, 2 * P))
    # More sharding never costs more memory, and N=1 gives the same resident states for every choice.
    for n in (1, 2, 64):
        full, grad, none = (model_state_bytes(P, n, c) for c in ("full", "grad_optim", "none"))
        assert full <= grad <= none
    assert len({state_bytes(P, 1, c).resident for c in SHARDINGS}) == 1


def test_bad_choices_are_named():
    with pytest.raises(CostModelError, match="unknown sharding 'zero3'.*full, grad_optim, none"):
        model_state_bytes(P, 8, "zero3")
    with pytest.raises(CostModelError, match="num_gpus must be >= 1"):
        model_state_bytes(P, 0, "full")


def test_capacities_use_the_formula_and_record_the_choice():
    model = ModelSpec(layers=8, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000, name="small")
    for sharding in SHARDINGS:
        cost = analytic_cost_model(model, "h100-80gb", 64, sharding=sharding)
        gpu = GPUS["h100-80gb"]
        free = gpu.memory_bytes * gpu.usable_memory - model_state_bytes(model.params, 64, sharding)
        per_token = activation_bytes_per_token(model, "none", precision_for(64, sharding))
        assert cost.token_capacity == math.floor(free / per_token)
        again = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
        assert assumed(again) == sharding == again.meta["sharding"]
    preset = cost_from_preset("gpt-7b", sharding="full")
    states_mb = model_state_bytes(get_model("gpt-7b").paper.params_b(384 * 1024) * 2**30, 64, "full") / 2**20
    assert preset.token_capacity == math.floor((30 * 1024 - states_mb) / get_model("gpt-7b").paper.act_mb_per_token)
    assert preset.token_capacity == 6407   # the paper's ZeRO-3 figure is unchanged
    assert cost_from_preset("gpt-7b", sharding="grad_optim").token_capacity < preset.token_capacity
    # Unsharded, an 8B model's states alone (18 bytes x 8B) overflow an 80 GB GPU: named, not planned.
    with pytest.raises(CostModelError, match="llama3-8b .*'none'.*model states leave no activation memory"):
        analytic_cost_model("llama3-8b", "h100-80gb", 64, sharding="none")
    # the paper's presets name their sizes in GiB too (they once printed megabytes as 0.00 GiB)
    states_gib = model_state_bytes(get_model("gpt-7b").paper.params_b(384 * 1024) * 2**30, 1, "full") / 2**30
    with pytest.raises(CostModelError, match=rf"they take {states_gib:.2f} GiB of the usable 30.00 GiB per GPU"):
        cost_from_preset("gpt-7b", num_gpus=1)
    # Older cost models never recorded it: they all assumed ZeRO-3.
    assert assumed({}) == "full"


def test_profile_capacity_uses_the_formula():
    pytest.importorskip("torch")
    from flexsp.profile.memory import capacity
    for sharding in SHARDINGS:
        cap = capacity(P / 8, 1e5, 80 * 2**30, sharding=sharding, num_gpus=16)
        assert cap.model_state_bytes == model_state_bytes(P / 8, 16, sharding) and cap.sharding == sharding


def test_runtime_refuses_a_capacity_that_assumed_more_sharding():
    check_runtime("none", "full")          # assumed less than it runs: fine (capacity is conservative)
    check_runtime("full", "full")
    with pytest.raises(CostModelError, match="assumes sharding 'full' but the runtime runs 'none'"):
        check_runtime("full", "none")
    with pytest.raises(CostModelError, match="assumes sharding 'grad_optim' but the runtime runs 'none'"):
        check_runtime("grad_optim", "none")
