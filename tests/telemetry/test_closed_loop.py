"""The refit reaches the plans: ``FlexSPLoader.set_cost`` swaps the cost model inside the planner process
(batches already submitted keep theirs), refuses a capacity change; and a short real run on 2 gloo ranks
with ``Telemetry(refit=True, on_refit=loader.set_cost)`` refits, hands the model to the loader and
lowers the group-time error."""
import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flexsp  # noqa: E402
from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.telemetry.records import group_errors, read_records  # noqa: E402
from runtime.distributed import run_distributed  # noqa: E402

from data import helpers  # noqa: E402  (tests/data/helpers.py)


def _predicted(plan, lengths, cost):
    return sum(max(cost.group_time([lengths[s] for s in g.seq_ids], g.degree) for g in mb.groups)
               for mb in plan.micro_batches)


def test_set_cost_reaches_the_planner_process():
    data = helpers.token_lists(120)
    a = helpers.cost_model()
    b = dataclasses.replace(a, alpha1=a.alpha1 * 100, beta1=a.beta1 * 3)
    config = LoaderConfig(batch_size=12, lookahead=1, plan=flexsp.PlanConfig(strategy="greedy"))
    with FlexSPLoader(data, a, helpers.cluster(), config, rank=0) as loader:
        steps = iter(loader)
        first = [next(steps) for _ in range(2)]
        assert loader._planner.mode == "process"
        loader.set_cost(b)
        later = [next(steps) for _ in range(4)]
        with pytest.raises(LoaderError, match="token capacity"):
            loader.set_cost(dataclasses.replace(b, token_capacity=a.token_capacity * 2))
    # planned before the swap: the step prepared ahead (prefetch); the one the planner held (lookahead 1) keeps
    # the old model too unless the swap reached the planner before the loader thread asked for it
    for step in first + later[:1]:
        assert step.plan.predicted_time == pytest.approx(_predicted(step.plan, step.lengths, a))
    for step in later[2:]:
        assert step.plan.predicted_time == pytest.approx(_predicted(step.plan, step.lengths, b))
        assert step.plan.predicted_time != pytest.approx(_predicted(step.plan, step.lengths, a))


SPEC = ModelSpec(vocab=helpers.VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)


def _run(rank, world, run_dir):
    from flexsp.runtime.fsdp import shard_model
    from flexsp.runtime.models.tiny import TinyLM
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor
    from flexsp.telemetry import RefitConfig, Telemetry

    torch.manual_seed(0)
    model = TinyLM(SPEC)
    shard_model(model, sharding="full", param_dtype=None)
    pool = GroupPool()
    cost = dataclasses.replace(helpers.cost_model(), alpha1=1e-6, beta1=1.0, meta={"sharding": "full"})  # far off
    loader = FlexSPLoader(helpers.token_lists(200, high=128), cost, helpers.cluster(world),
                          LoaderConfig(batch_size=8, lookahead=1, plan=flexsp.PlanConfig(strategy="greedy")), pool=pool)
    telemetry = Telemetry(run_dir, cost, spec=SPEC, log_every=0, refit=RefitConfig(min_points=4),
                          on_refit=loader.set_cost)
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, cost=cost, backend="sdpa",
                            probe=telemetry.probe, failure_name="loop")
    for n, step in enumerate(loader):
        executor.step(step)
        telemetry.flush()     # the test wants the refit applied at the next step; training never waits
        if n == 7:
            break
    telemetry.close()
    executor.close()
    loader.close()
    return {"cost": loader.cost.to_dict(), "error": telemetry.error}


def test_short_run_refits_and_hands_the_model_to_the_loader(tmp_path):
    out = run_distributed(_run, 2, str(tmp_path))
    assert out[0]["error"] is None and out[1]["error"] is None
    records = read_records(tmp_path)
    assert len(records) == 8 and [r["step"] for r in records] == list(range(8))
    assert all(r["plan_wait"] >= 0 and r["load_seconds"] >= 0 for r in records)   # the loop's wait: ~0 when prefetched
    refits = [json.loads(line) for line in (tmp_path / "refits.jsonl").read_text().splitlines()]
    # a record is predicted by the model of the refits after earlier steps; the loader got each at the next step
    assert [r["cost_version"] for r in records] == [sum(f["step"] < r["step"] for f in refits) for r in records]
    applied = [f for f in refits if f["step"] < records[-1]["step"]][-1]
    assert applied["version"] >= 1 and out[0]["cost"] == applied["cost_model"] and out[0]["cost"]["alpha1"] != 1e-6
    assert all(r["cost_model"]["token_capacity"] == helpers.TOKEN_CAPACITY for r in refits)
    first = float(np.median(np.abs(group_errors(records[0]))))
    last = float(np.median(np.abs(np.concatenate([group_errors(r) for r in records[-3:]]))))
    assert first > 0.5 and last < first / 2
