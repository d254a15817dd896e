"""The SP group pool: aligned blocks only, collective creation, restricted degrees, stats."""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from flexsp import PlanError  # noqa: E402
from flexsp.runtime.pool import GroupPool, tiles  # noqa: E402

from .distributed import run_distributed  # noqa: E402


def _pool_worker(rank, world_size, degrees):
    pool = GroupPool(degrees=degrees)
    sums = {}
    for ranks in tiles(world_size, pool.degrees, pool.gpus_per_node):
        if rank in ranks and len(ranks) > 1:
            # The communicator really spans exactly these ranks.
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=pool.get(ranks))
            sums[ranks] = float(x)
    return {"count": pool.stats.count, "per_rank": pool.stats.per_rank, "seconds": pool.stats.seconds,
            "sums": sums, "degrees": pool.degrees, "warmed": pool.stats.warmed}


@pytest.mark.parametrize("world_size", [4, 8])
def test_pool_holds_every_aligned_block(world_size):
    results = run_distributed(_pool_worker, world_size, None)
    log2 = world_size.bit_length() - 1
    for rank, res in enumerate(results):
        assert res["count"] == world_size - 1          # N/2 + N/4 + ... + 1 groups of degree >= 2
        assert res["per_rank"] == log2                 # one communicator per degree > 1
        for ranks, total in res["sums"].items():
            assert total == sum(ranks)
        assert len(res["sums"]) == log2
        assert res["warmed"]                           # every communicator ran a collective inside the timing
    seconds = max(r["seconds"] for r in results)
    print(f"\npool world={world_size}: {results[0]['count']} groups, {results[0]['per_rank']} per rank, "
          f"{seconds:.3f}s")


def _restricted_worker(rank, world_size):
    pool = GroupPool(degrees=(1, 4))
    with pytest.raises(PlanError, match=r"ranks \[0, 1\] is not in the pool.*degrees \[1, 4\]"):
        pool.get((0, 1))
    x = torch.ones(1)
    dist.all_reduce(x, group=pool.get((0, 1, 2, 3)))
    return pool.stats.count, pool.stats.per_rank, pool.get((rank,)), float(x)


def test_pool_restricted_to_some_degrees():
    for count, per_rank, single, total in run_distributed(_restricted_worker, 4):
        assert (count, per_rank, single, total) == (1, 1, None, 4.0)


def test_pool_without_process_group_is_a_world_of_one():
    pool = GroupPool()
    assert (pool.world_size, pool.rank, pool.degrees, pool.stats.count, pool.stats.per_rank) == (1, 0, (1,), 0, 0)
    assert pool.get((0,)) is None


def test_pool_rejects_unusable_degrees_and_blocks():
    with pytest.raises(PlanError, match=r"pool degrees \[2, 3\].*world size 1"):
        GroupPool(degrees=(2, 3))
    pool = GroupPool()
    assert not pool.has((1,)) and not pool.has((0, 1))
    assert tiles(8, (2, 4)) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert tiles(6, (4,)) == [(0, 1, 2, 3)]   # a partial block is never a group


def test_a_world_of_one_takes_no_port_and_leaves_the_environment_alone(tmp_path):
    """Without a launch, init_distributed starts a world of one over an in-process store. It used to set
    MASTER_PORT=29500 (and RANK, WORLD_SIZE) in this process's environment and listen there, so a later
    torchrun, or any script it started, failed with EADDRINUSE on the default port."""
    import os
    import subprocess
    import sys
    code = ("import os, torch.distributed as dist\n"
            "from flexsp.runtime.pool import init_distributed\n"
            "init_distributed()\n"
            "import torch; t = torch.ones(1); dist.all_reduce(t)\n"
            "print(dist.get_world_size(), float(t), sorted(k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', "
            "'MASTER_PORT') if k in os.environ))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                           "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "1 1.0 []"
