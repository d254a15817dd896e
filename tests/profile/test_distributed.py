"""All-to-all sweep and plan check in a 4-process gloo world (the shared fixture in tests/runtime)."""
import pytest

torch = pytest.importorskip("torch")

from runtime.distributed import run_distributed  # noqa: E402  (tests/ is on sys.path, see conftest.py)

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.profile import fit_bandwidth, model_spec  # noqa: E402

SPEC = model_spec("tiny", layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
SIZES = [2**12, 2**16, 2**20, 2**22]     # 4 KiB .. 4 MiB: big enough that size, not noise, sets the time


def _sweep_worker(rank, world_size):
    from flexsp.profile.bandwidth import alltoall_sweep
    from flexsp.profile.compute import DeviceSetup
    from flexsp.runtime.pool import GroupPool
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
    from flexsp.runtime.pool import GroupPool
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


# --- worlds that are not powers of two: ranks past the last aligned block sit a degree out -------------

def _profile_cli_worker(rank, world_size, out_dir):
    from flexsp.profile.cli import main
    code = main(["profile", "--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                 "--vocab", "64", "--lengths", "32,64,128,256", "--repeats", "2", "--warmup", "1", "--clock", "cpu",
                 "--statistic", "min",   # CPU time and the fastest repeat: a loaded machine cannot flatten the fit
                 "--comm-sizes", "256K,4M,16M", "--memory-gb", "1", "--threads", "1", "--check", "auto",
                 "--gpus-per-node", str(world_size), "--quiet", "--force", "-o", f"{out_dir}/cost.json"])
    return code


@pytest.mark.parametrize("world", [3, 6])
def test_flexsp_profile_runs_on_a_world_that_is_not_a_power_of_two(world, tmp_path):
    """Before: rank 2 of 3 asked the pool for the block [2, 3], raised, and the others hung in a barrier."""
    from flexsp import CostModel
    codes = run_distributed(_profile_cli_worker, world, str(tmp_path), timeout=60)
    assert codes == [0] * world
    cost = CostModel.load(tmp_path / "cost.json")
    expected = [d for d in (2, 4) if d <= world]
    assert sorted(cost.alltoall_bandwidth) == expected
    assert cost.meta["check"]["groups"] > 0 and cost.meta["world_size"] == world
    largest = 4 if world == 6 else 2               # the ring hop ran on the largest pooled tile; the rest sat out
    assert cost.meta["ring"]["tiles"] == [[0, largest - 1]] and cost.meta["ring"]["rings"] == [list(range(largest))]


@pytest.mark.parametrize("world", [3, 6, 24, 48])
def test_every_rank_of_a_world_agrees_who_sits_out_of_each_degree(world):
    from flexsp.profile.bandwidth import block_of, participants
    from flexsp.runtime.pool import tiles
    for degree in (d for d in (2, 4, 8, 16, 32, 64) if d <= world):
        blocks = [block_of(r, world, degree) for r in range(world)]
        taking_part = [r for r, b in enumerate(blocks) if b is not None]
        assert len(taking_part) == participants(world, degree) == world - world % degree
        assert taking_part == list(range(len(taking_part)))             # only the tail sits out
        assert sorted({b for b in blocks if b}) == tiles(world, [degree])   # the pool's blocks
        for r in taking_part:
            assert r in blocks[r] and len(blocks[r]) == degree and blocks[r][0] % degree == 0
    assert participants(48, 32) == 32 and block_of(40, 48, 32) is None and block_of(47, 48, 16) == tuple(range(32, 48))
    assert participants(24, 16) == 16 and block_of(16, 24, 16) is None and block_of(23, 24, 8) == tuple(range(16, 24))


def test_profiled_blocks_are_the_pools_tiles_for_any_degree():
    from flexsp.profile.bandwidth import block_of, participants
    from flexsp.runtime.pool import tiles
    for world, node in ((12, 6), (16, 8), (24, 8), (9, 3)):
        for degree in range(2, world + 1):
            blocks = [block_of(r, world, degree, node) for r in range(world)]
            assert sorted({b for b in blocks if b}) == tiles(world, [degree], node)
            assert sum(b is not None for b in blocks) == participants(world, degree, node)
            assert all(b is None or r in b for r, b in enumerate(blocks))
    assert block_of(7, 16, 3, 8) is None and block_of(9, 16, 3, 8) == (8, 9, 10)   # a node's leftover ranks sit out


def test_planning_cluster_for_partial_and_multi_node_worlds():
    from flexsp.errors import ClusterError
    from flexsp.profile.cli import planning_cluster
    assert (planning_cluster(3, 3).num_gpus, planning_cluster(3, 3).gpus_per_node) == (3, 4)
    assert planning_cluster(6, 8).gpus_per_node == 8
    assert (planning_cluster(24, 8).num_nodes, planning_cluster(48, 8).num_nodes) == (3, 6)
    assert planning_cluster(24, 6).num_nodes == 4          # any node size (groups sit on tiles)
    with pytest.raises(ClusterError, match="not a multiple of gpus_per_node=8"):
        planning_cluster(20, 8)


def _profile_bad_input_worker(rank, world_size, out_dir):
    import contextlib
    import io

    from flexsp.profile.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["profile", "--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
                     "--vocab", "64", "--lengths", "32,64,128", "--repeats", "1", "--memory-gb", "1", "--quiet",
                     "-o", f"{out_dir}/cost.json"])
    return code, err.getvalue()


def test_a_fit_error_on_rank_0_stops_every_rank_with_the_same_exit_code(tmp_path):
    """Too few lengths for the compute fit: rank 0 raises; before, the others died in the broadcast."""
    out = run_distributed(_profile_bad_input_worker, 2, str(tmp_path), timeout=40)
    assert [code for code, _ in out] == [2, 2]
    assert out[0][1] == out[1][1] and "compute fit needs at least 4 distinct sequence lengths" in out[0][1]
