"""Per-step records on 4 gloo ranks: every field present, measured times positive and consistent with
the step time, planned times those of the cost model, tokens those of the plan; one JSON line per step."""
import json
import re

import pytest

torch = pytest.importorskip("torch")

from flexsp import CostModel, Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.telemetry.records import (GROUP_FIELDS, RANK_FIELDS, RANK_MB_FIELDS, STEP_FIELDS,  # noqa: E402
                                      STEP_OPTIONAL, model_flops, read_records)
from runtime.distributed import run_distributed  # noqa: E402

LENGTHS = [9, 17, 5, 12, 3, 7, 11, 2, 6, 13]
SPEC = ModelSpec(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)
COST = CostModel(alpha1=1e-9, alpha2=1e-6, beta1=1e-4, comm_bytes_per_token=1024.0,
                 alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=64)


def _plan(*micro_batches):
    return Plan(num_gpus=4, predicted_time=0.5, strategy="test", micro_batches=tuple(
        MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in mb)) for mb in micro_batches))


PLANS = [_plan([((0, 1, 2, 3), (1, 3))],
               [((0, 1), (0, 4, 5)), ((2,), (6,))],                       # rank 3 idles
               [((0,), (7,)), ((1,), (8,)), ((2, 3), (2, 9))]),
         _plan([((2, 3), (0, 1, 2)), ((0, 1), (3,))],
               [((1,), (4,))],
               [((0, 1, 2, 3), (5, 6, 7, 8, 9))])]


SUPERVISED = sum(n - n // 2 - (1 if n // 2 == 0 else 0) for n in LENGTHS)   # completion targets (never position 0)


def _worker(rank, world, run_dir):
    from flexsp.runtime.fsdp import shard_model
    from flexsp.runtime.models.tiny import TinyLM
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor
    from flexsp.telemetry import Telemetry

    torch.manual_seed(0)
    model = TinyLM(SPEC)
    shard_model(model, sharding="full", param_dtype=None)
    pool = GroupPool()
    lines = []
    telemetry = Telemetry(run_dir, COST, spec=SPEC, peak_flops=1e11, log_every=2, log=lines.append)
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, backend="sdpa",
                            probe=telemetry.probe, failure_name="telemetry")
    seconds = []
    for i in range(4):
        batch = [torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(10 * i + k))
                 for k, n in enumerate(LENGTHS)]
        if i >= 2:   # SFT rows: the prompt half carries no loss
            batch = [{"input_ids": t, "completion_mask": [0] * (n // 2) + [1] * (n - n // 2)}
                     for t, n in zip(batch, LENGTHS)]
        seconds.append(executor.run_plan(PLANS[i % 2], batch).seconds)
    telemetry.close()
    executor.close()
    return {"seconds": seconds, "lines": lines, "error": telemetry.error}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    out = run_distributed(_worker, 4, str(run_dir))
    return run_dir, out


def test_every_field_on_every_rank(recorded):
    run_dir, out = recorded
    assert all(o["error"] is None for o in out)
    records = read_records(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for rec in records:
        assert set(STEP_FIELDS) <= set(rec)
        assert [k for k in STEP_FIELDS if rec[k] is None and k not in STEP_OPTIONAL] == []
        assert rec["mfu"] is not None and rec["model_flops"] == pytest.approx(model_flops(SPEC, LENGTHS))
        assert rec["world"] == 4 and [r["rank"] for r in rec["ranks"]] == [0, 1, 2, 3]
        for r in rec["ranks"]:
            assert set(RANK_FIELDS) <= set(r) and all(r[k] is not None for k in RANK_FIELDS)
            for mb in r["micro_batches"]:
                assert set(RANK_MB_FIELDS) <= set(mb)
                assert None not in (mb["start"], mb["forward"], mb["end"], mb["busy"])   # CPU, one thread: busy known
        for mb in rec["micro_batches"]:
            for g in mb["groups"]:
                assert set(GROUP_FIELDS) <= set(g) and all(g[k] is not None for k in GROUP_FIELDS)
    assert json.loads((run_dir / "run.json").read_text())["world"] == 4
    assert len(out[0]["lines"]) == 2 and out[0]["lines"][0].startswith("step 1 |") and "fallbacks 0/2" in out[0]["lines"][0]
    assert all(o["lines"] == [] for o in out[1:])   # only rank 0 logs


def test_measured_times_positive_and_consistent_with_the_step(recorded):
    run_dir, out = recorded
    for i, rec in enumerate(read_records(run_dir)):
        plan = PLANS[i % 2]
        for r, rank in enumerate(rec["ranks"]):
            mbs = rank["micro_batches"]
            assert len(mbs) == len(plan.micro_batches)
            last = 0.0
            for m, mb in enumerate(mbs):
                assert last <= mb["start"] < mb["forward"] < mb["end"]     # in order, positive durations
                assert 0 < mb["busy"] <= (mb["end"] - mb["start"]) * 1.05 + 1e-4   # CPU time within the wall time
                group = plan.micro_batches[m].group_of_rank(r)
                assert (mb["group"] is None) == (group is None)
                last = mb["end"]
            # check + micro-batches + tail is the step, and the step is what the executor measured
            assert rank["check_seconds"] + mbs[-1]["end"] + rank["tail_seconds"] == pytest.approx(rank["seconds"])
            assert rank["check_seconds"] >= 0 and rank["tail_seconds"] > 0
            assert rank["seconds"] >= out[r]["seconds"][i] > 0
            assert 0 <= rank["idle_seconds"] <= rank["seconds"]
            assert 0 < rank["probe_seconds"] < rank["seconds"]   # its size is measured by the benchmark
        assert rec["seconds"] == max(r["seconds"] for r in rec["ranks"])
        assert 0 < sum(mb["measured"] for mb in rec["micro_batches"]) <= rec["seconds"]
        for m, mb in enumerate(rec["micro_batches"]):
            assert [g["ranks"] for g in mb["groups"]] == [list(g.ranks) for g in plan.micro_batches[m].groups]
            for g, pg in zip(mb["groups"], plan.micro_batches[m].groups):
                assert g["lengths"] == [LENGTHS[s] for s in pg.seq_ids]
                assert g["planned"] == pytest.approx(COST.group_time(g["lengths"], pg.degree))
                assert 0 < g["measured"] <= g["wall"] <= mb["measured"]
            assert mb["planned"] == max(g["planned"] for g in mb["groups"])
        # every rank's real tokens add up to the batch
        tokens = sum(x["tokens"] for r in rec["ranks"] for x in r["micro_batches"])
        assert tokens == rec["tokens"] == sum(LENGTHS)
        assert rec["supervised_tokens"] == (SUPERVISED if i >= 2 else sum(n - 1 for n in LENGTHS))
        assert rec["planned_seconds"] == pytest.approx(sum(mb["planned"] for mb in rec["micro_batches"]))
        assert rec["plan_predicted"] == 0.5 and rec["token_capacity"] == 64


def test_report_command_on_the_recorded_run(recorded, tmp_path, capsys):
    from matplotlib.image import imread

    from flexsp.cli import main
    from flexsp.telemetry.report import PLOTS
    run_dir, _ = recorded
    assert main(["report", str(run_dir), "--step", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("steps", "4 (world 4, strategy test)", "tokens/s", "MFU", "idle in collectives", "waiting for the loader",
                "fallback plans", "0 of 4", "cost-model refits", "median |group error|", "peak memory", "token capacity"):
        assert row in out
    for name in PLOTS:
        assert f"wrote {tmp_path / name}" in out
        image = imread(tmp_path / name)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0   # a drawn picture, not blank
    total = 2 * sum(n - 1 for n in LENGTHS) + 2 * SUPERVISED
    assert re.search(rf"supervised tokens \(loss targets\) / tokens\s+{total:,} / {4 * sum(LENGTHS):,} \(", out)
    assert main(["report", str(run_dir), "--step", "99"]) == 2
    assert "--step 99 is not in" in capsys.readouterr().err
