"""Activation checkpointing: "selective" (attention core) and "full" (whole layer) keep fewer bytes for
backward than "none", per layer as asked, with gradients unchanged; the planner's capacity comes from the
same setting through the one capacity function, and TrainConfig hands it to the executor."""
import pytest

torch = pytest.importorskip("torch")

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.errors import FlexSPError  # noqa: E402
from flexsp.plan.analytic import analytic_cost_model  # noqa: E402
from flexsp.plan.config import PlanConfig  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.config import TrainConfig  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.shard import pack  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

SPEC = ModelSpec(vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64)


def _run(recompute):
    """(saved bytes of distinct storages during forward, gradients) of one packed micro-batch."""
    torch.manual_seed(5)
    model = TinyLM(SPEC, recompute=recompute).double()
    g = torch.Generator().manual_seed(2)
    p = pack([torch.randint(1, 64, (n,), generator=g) for n in (30, 17, 9)], degree=1)
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    seen = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model.shard_loss(p.input_ids, p.position_ids, p.labels, p.context())
    loss.backward()
    return sum(seen.values()), [q.grad.clone() for q in model.parameters()]


def test_recompute_keeps_less_and_changes_no_gradient():
    saved = {}
    grads = {}
    for mode in ("none", "selective", "full", ["full", "none", "selective"]):
        key = mode if isinstance(mode, str) else "mixed"
        saved[key], grads[key] = _run(mode)
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["full"] < saved["mixed"] < saved["none"]
    for key in ("selective", "full", "mixed"):
        for a, b in zip(grads[key], grads["none"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_capacity_and_compute_follow_the_same_setting():
    models = {m: analytic_cost_model("llama-7b", "h100-80gb", 8, recompute=m) for m in ("none", "selective", "full")}
    assert models["none"].token_capacity < models["selective"].token_capacity < models["full"].token_capacity
    assert models["none"].alpha1 < models["selective"].alpha1 == models["full"].alpha1
    assert models["none"].alpha2 == models["selective"].alpha2 < models["full"].alpha2
    assert analytic_cost_model("llama-7b", "h100-80gb", 8, recompute=True).token_capacity == models["full"].token_capacity
    assert PlanConfig(recompute=False).recompute == "none"
    with pytest.raises(FlexSPError, match="recompute must be one of none, selective, full"):
        PlanConfig(recompute="half")


def test_train_config_sets_the_models_recompute():
    model = TinyLM(SPEC).double()
    plan = Plan(num_gpus=1, predicted_time=0.0, micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=(0,)),)),))
    StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), GroupPool(),
                 config=TrainConfig(recompute="selective", param_dtype=None)).run_plan(plan, [torch.arange(1, 20)])
    assert [b.recompute for b in model.blocks] == ["selective"] * 3 and all(b.attn.recompute for b in model.blocks)
    with pytest.raises(FlexSPError):
        TrainConfig(recompute="sometimes")
