"""All-to-all sweep and plan check in a 4-process gloo world (the shared fixture in tests/runtime)."""
import pytest

torch = pytest.importorskip("torch")

from runtime.distributed import run_distributed  # noqa: E402  (tests/ is on sys.path, see conftest.py)

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.profile import fit_bandwidth, model_spec  # noqa: E402

SPEC = model_spec("tiny", layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
SIZES = [2**12, 2**16, 2**20, 2**22]     # 4 KiB .. 4 MiB: big enough that size, not noise, sets the time


def _sweep_worker(rank, world_size):
    from flexsp.profile.comm import alltoall_sweep
    from flexsp.profile.compute import DeviceSetup
    from flexsp.runtime.groups import GroupPool
    samples = alltoall_sweep(GroupPool(), DeviceSetup.resolve("cpu"), SIZES, repeats=2, warmup=2)
    return [(s.degree, s.payload_bytes, s.seconds) for s in samples]


def test_alltoall_sweep_on_every_pooled_degree():
    results = run_distributed(_sweep_worker, 4)
    assert all(r == results[0] for r in results)            # every rank gets the slowest-rank times
    samples = results[0]
    assert sorted({d for d, _, _ in samples}) == [2, 4]
    for degree in (2, 4):
        mine = [(b, t) for d, b, t in samples if d == degree]
        assert sorted({b for b, _ in mine}) == SIZES           # sizes divisible by 4 bytes x degree stay exact
        fit = fit_bandwidth(degree, [b for b, _ in mine], [t for _, t in mine], statistic="min")
        assert fit.bandwidth > 0 and fit.latency >= 0


def _plan():
    groups = [[((0, 1, 2, 3), (0, 1))], [((0, 1), (2,)), ((2,), (3,)), ((3,), (4,))], [((0,), (5,))]]
    mbs = tuple(MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in mb)) for mb in groups)
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=mbs)


def _check_worker(rank, world_size, plan_dict, lengths, cost_dict):
    from flexsp import CostModel
    from flexsp.profile.check import check_plan
    from flexsp.profile.compute import DeviceSetup, GroupRunner
    from flexsp.runtime.groups import GroupPool
    runner = GroupRunner(SPEC, DeviceSetup.resolve("cpu"))
    report = check_plan(Plan.from_dict(plan_dict), lengths, CostModel.from_dict(cost_dict), runner, GroupPool(),
                        repeats=1, warmup=0)
    return report.to_dict()


def test_check_runs_every_group_of_a_plan_on_four_ranks():
    lengths = [64, 32, 96, 48, 16, 80]
    from flexsp import CostModel
    model = CostModel(1e-8, 1e-5, 1e-3, 1000.0, {2: 1e9, 4: 1e9}, 10_000)
    reports = run_distributed(_check_worker, 4, _plan().to_dict(), lengths, model.to_dict())
    assert all(r == reports[0] for r in reports)
    groups = reports[0]["groups"]
    assert [(g["micro_batch"], g["group"], g["degree"], g["tokens"]) for g in groups] == [
        (0, 0, 4, 96), (1, 0, 2, 96), (1, 1, 1, 48), (1, 2, 1, 16), (2, 0, 1, 80)]
    assert all(g["measured"] > 0 for g in groups)
    assert groups[0]["predicted"] == pytest.approx(model.group_time([64, 32], 4))
    assert groups[2]["predicted"] == pytest.approx(model.group_time([48], 1))
    assert reports[0]["skipped"] == []
