"""The loader's Step through the FSDP2-sharded executor: same update as one device, ~1/N model states per
rank (measured), and the capacity's sharding checked against the runtime's."""
import pytest

torch = pytest.importorskip("torch")

from flexsp import Cluster, CostModel  # noqa: E402
from flexsp.data import FlexSPLoader, LoaderConfig  # noqa: E402
from flexsp.errors import CostModelError  # noqa: E402
from flexsp.plan.memory import state_bytes  # noqa: E402
from flexsp.runtime.fsdp import shard_model  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402
from .test_executor import PLAN_A, _batch, _full_params, _model, _optimizer, _reference  # noqa: E402


def _cost(sharding):
    return CostModel(alpha1=1e-9, alpha2=1e-6, beta1=1e-4, comm_bytes_per_token=64.0,
                     alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=40, meta={"sharding": sharding})


def _bytes(tensors):
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)


def _state_bytes(model, optimizer):
    """Bytes this rank holds: parameters, gradients, optimizer states (AdamW's scalar step counters aside)."""
    params = list(model.parameters())
    moments = [v for p in params for k, v in optimizer.state[p].items() if k != "step"]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params), "optimizer": _bytes(moments)}


def _loader_worker(rank, world_size, sharding, opt_name):
    pool = GroupPool()
    dataset = [seq.tolist() for seq in _batch(0)]     # the test batch, in plan seq-id order (no shuffle)
    cost = _cost(sharding)
    loader = FlexSPLoader(dataset, cost, Cluster(num_gpus=4, gpus_per_node=4),
                          LoaderConfig(batch_size=len(dataset), shuffle=False, lookahead=0), pool=pool,
                          planner=lambda lengths: PLAN_A)
    model = _model(True)
    if sharding != "plain":
        shard_model(model, sharding=sharding, param_dtype=None)
    optimizer = _optimizer(opt_name, model.parameters())
    executor = StepExecutor(model, optimizer, pool, cost=cost if sharding != "plain" else None, backend="sdpa",
                            failure_name=f"loader-{sharding}")
    step = next(iter(loader))
    result = executor.step(step)
    loader.close()
    refused = None
    if sharding == "none":   # a capacity computed for full sharding must not run on replicated states
        try:
            StepExecutor(model, optimizer, pool, cost=_cost("full"), failure_name="refused")
        except CostModelError as exc:
            refused = str(exc)
    return {"params": _full_params(model), "result": result, "bytes": _state_bytes(model, optimizer),
            "refused": refused}


@pytest.mark.parametrize("sharding", ["full", "none"])
def test_loader_step_sharded_equals_one_device_and_states_are_one_nth(sharding):
    runs = run_distributed(_loader_worker, 4, sharding, "adamw")
    want, losses = _reference([PLAN_A.to_dict()], True, "adamw")
    for run in runs:
        assert abs(want - run["params"]).max() < 1e-10
        assert run["result"].loss == pytest.approx(losses[0], rel=1e-12)
    assert [r["result"].degrees for r in runs] == [(4, 2, 1), (4, 2, 1), (4, 1, 2), (4, None, 2)]
    # Memory: every dim of this model divides by 4, so FSDP2's dim-0 shards are exactly 1/N (tolerance
    # 1%: a parameter whose rows do not divide by N would put up to one extra row on some ranks).
    params = want.size
    formula = state_bytes(params, 4, sharding, master_bytes=8, grad_bytes=8, optimizer_bytes=16, compute_bytes=8)
    for run in runs:
        got = run["bytes"]
        assert got["params"] == pytest.approx(formula.params, rel=0.01)
        assert got["grads"] == pytest.approx(formula.grads, rel=0.01)
        assert got["optimizer"] == pytest.approx(formula.optimizer, rel=0.01)
    if sharding == "full":   # nothing replicated: the shards add up to exactly one model
        assert sum(r["bytes"]["params"] for r in runs) == params * 8
        assert runs[0]["bytes"]["params"] == pytest.approx(params * 8 / 4, rel=0.01)
        assert all(r["refused"] is None for r in runs)
    else:
        assert all("assumes sharding 'full' but the runtime runs 'none'" in r["refused"] for r in runs)
