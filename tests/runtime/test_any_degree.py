"""SP groups of non-power-of-two degrees (3, 5, 6, 12) on 12 gloo ranks in nodes of 6 equal one process.

One 12-rank run builds the pools and takes one planned step; the tests read its results:
- the pool holds exactly the tiles of 3, 5, 6 and 12 plus the hybrid sub-groups and rings, each spanning
  the ranks it says, and a rank holds as many communicators as the stated bound where nothing is shared;
- a hand-built plan whose micro-batches mix Ulysses 6, Ulysses 3, a pure ring of 3, Ulysses 2 x ring 3,
  Ulysses 3 x ring 2, on all 12 ranks Ulysses 6 x ring 2, and two rings of 5 beside idle ranks gives the
  loss and every gradient of the one-process step (fp64, 6 query heads over 2 kv heads: kv heads
  replicated under Ulysses 3 and 6).
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexsp import Cluster, Group, MicroBatch, Plan, PlanError  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool, communicator_bound, tiles  # noqa: E402
from flexsp.runtime.shard import loss_tokens  # noqa: E402
from flexsp.runtime.sp.ring_comm import place, split_blocks  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

WORLD, NODE = 12, 6
DEGREES = (1, 3, 5, 6, 12)
SPLITS = [(1, 3), (1, 5), (2, 3), (3, 2), (6, 2)]
# lengths shorter than 2 x ring, not divisible by the degree, and a single token
LENGTHS = [23, 3, 17, 9, 1, 12, 7, 30, 5, 2, 14, 6, 11, 4, 19, 8, 25, 13, 21, 9, 4]
VOCAB = 64
CFG = dict(vocab=VOCAB, hidden=24, layers=2, heads=6, kv_heads=2, ffn=32, tie_embeddings=True)


def _plan() -> Plan:
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=WORLD, gpus_per_node=NODE, predicted_time=0.0, micro_batches=(
        mb((range(0, 6), (0, 1), 1), (range(6, 9), (2, 3), 1), (range(9, 12), (4, 5), 3)),   # U6 | U3 | ring 3
        mb((range(0, 3), (6,), 1), (range(3, 6), (7, 8), 3), (range(6, 12), (9, 10, 11), 3)),  # U3 | ring 3 | 2x3
        mb((range(0, 6), (12, 13), 2), (range(6, 12), (14, 15), 1)),                          # 3x2 | U6
        mb((range(0, 12), (16, 17), 2)),                                                        # 6x2 on two nodes
        mb((range(0, 5), (18,), 5), (range(6, 11), (19, 20), 5)),          # rings of 5; ranks 5 and 11 idle
    ))


def _batch():
    ids = torch.randint(1, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(11))
    return list(ids.split(LENGTHS))


def _model():
    torch.manual_seed(5)
    return TinyLM(ModelSpec(**CFG)).double()


def _spans(rank, groups):
    """All-reduce this rank's id over each listed group it belongs to; {ranks: sum}."""
    sums = {}
    for ranks, handle in groups:
        if rank in ranks:
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=handle)
            sums[ranks] = float(x)
    return sums


def _worker(rank, world_size):
    # A pool where no sub-group coincides with a tile: the bound is met exactly (heads=4 derives 1x3 and 2x3);
    # its node size comes from torchrun's variable.
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE)
    tight = GroupPool(degrees=(1, 3, 6), heads=4)
    del os.environ["LOCAL_WORLD_SIZE"]
    pool = GroupPool(degrees=DEGREES, splits=SPLITS, gpus_per_node=NODE)
    from_cluster = GroupPool(cluster=Cluster(WORLD, NODE), warm_up=False).degrees   # the planner's default set
    subs, rings = split_blocks(WORLD, pool.splits, NODE)
    spans = _spans(rank, [(t, pool.get(t) if rank in t else None) for t in tiles(WORLD, DEGREES, NODE) if len(t) > 1])
    hybrid_sums = {}
    for u, r in pool.splits:                       # one global order: every member reaches a group together
        for t in tiles(WORLD, [u * r], NODE):
            if rank in t:
                sub, ring, _ = place(rank, t, u)
                sub_group, ring_group = pool.ring_groups(t, r)
                hybrid_sums[(t, r)] = (sub, ring, _spans(rank, [(sub, sub_group)] if u > 1 else []),
                                       _spans(rank, [(ring, ring_group)]))
    errors = []
    # off-tile 3 and 6, an unpooled degree, and the splits 1 x 6 and 4 x 3 the pool does not hold
    for ranks, ring in (((1, 2, 3), 1), ((3, 4, 5, 6, 7, 8), 1), ((0, 1, 2, 3), 1), (tuple(range(6)), 6),
                        (tuple(range(12)), 3)):
        try:
            pool.check(ranks, ring)
        except PlanError as exc:
            errors.append(str(exc))

    model = _model()
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.5), pool, backend="sdpa")
    result = executor.run_plan(_plan(), _batch())
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    executor.close()
    return {"from_cluster": from_cluster, "tight": (tight.stats.count, tight.stats.per_rank, tight.communicator_bound, tight.splits,
                      tight.gpus_per_node),
            "count": pool.stats.count, "per_rank": pool.stats.per_rank, "bound": pool.communicator_bound,
            "spans": spans, "hybrid": hybrid_sums, "subs": subs, "rings": rings,
            "errors": errors, "loss": result.loss, "tokens": result.tokens_processed, "degrees": result.degrees,
            "grads": grads}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, WORLD, timeout=180)


def test_pool_holds_tiles_of_any_degree_within_the_bound(runs):
    assert all(r["from_cluster"] == Cluster(WORLD, NODE).degrees == (1, 2, 3, 4, 6, 12) for r in runs)
    for rank, run in enumerate(runs):
        count, per_rank, bound, splits, node = run["tight"]
        assert node == NODE
        assert splits == ((1, 3), (2, 3))                 # gcd(3, 4) = 1 -> ring 3; gcd(6, 4) = 2 -> 2 x 3
        assert count == 4 + 2 + 6 + 4                    # tiles of 3 and 6, Ulysses pairs, rings of stride 2
        assert per_rank == bound == communicator_bound((1, 3, 6), splits) == 4
        # main pool: 7 tiles; 2x3 adds 6 pairs + 4 rings; 3x2 and 6x2 reuse tiles as sub-groups, add 6 + 6 rings
        # main pool: 9 tiles (3: 4, 5: 2, 6: 2, 12: 1); rings of 3 and 5 are tiles; 2x3 adds 6 pairs + 4 rings;
        # 3x2 and 6x2 reuse tiles as their Ulysses sub-groups and add 6 + 6 rings
        assert run["count"] == 9 + 10 + 6 + 6
        in_five = rank % NODE < 5                        # a node of 6 holds one tile of 5
        assert run["per_rank"] == 7 + in_five <= run["bound"] == 4 + 2 * 3
        assert set(run["spans"]) == {t for t in tiles(WORLD, DEGREES, NODE) if rank in t and len(t) > 1}
        for ranks, total in run["spans"].items():
            assert total == sum(ranks)                   # each communicator spans exactly its ranks
        assert {(t, r) for t, r in run["hybrid"]} == {(t, r) for u, r in SPLITS for t in tiles(WORLD, [u * r], NODE)
                                                      if rank in t}
        for (tile, ring), (sub, mine, sub_sums, ring_sums) in run["hybrid"].items():
            u = len(tile) // ring
            assert sub == tile[tile.index(rank) // u * u:][:u] and (u == 1 or sub in run["subs"])
            assert mine == tile[tile.index(rank) % u::u] and mine in run["rings"]
            assert sub_sums == ({sub: sum(sub)} if u > 1 else {}) and ring_sums == {mine: sum(mine)}
    first = runs[0]["errors"]
    assert len(first) == 5
    assert all("is not in the pool" in e for e in first[:3]) and "tiles of degrees [1, 3, 5, 6, 12]" in first[0]
    assert "runs 1 x 6" in first[3] and "runs 4 x 3" in first[4]


def test_non_power_of_two_step_equals_one_process(runs):
    model = _model()
    batch = _batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # a tiny model: one thread, not two spinning ones on a shared, loaded machine
    try:
        loss = sum(F.cross_entropy(model(s)[:-1], s[1:], reduction="sum") for s in batch if s.numel() > 1)
        loss = loss / loss_tokens(LENGTHS)
        loss.backward()
    finally:
        torch.set_num_threads(threads)
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    for run in runs:
        assert run["loss"] == pytest.approx(loss.item(), rel=1e-12)
        np.testing.assert_allclose(run["grads"], want, rtol=1e-9, atol=1e-12)
    assert sum(r["tokens"] for r in runs) == sum(LENGTHS)     # every token once, none twice
    assert runs[0]["degrees"] == (6, 3, 6, 12, 5) and runs[9]["degrees"] == (3, 6, 6, 12, 5)
    assert runs[11]["degrees"][-1] is None and runs[11]["tokens"] > 0     # idle in the last micro-batch only


def test_tiles_and_refusals_without_a_process_group(monkeypatch):
    assert tiles(12, (3, 4, 12), 6) == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11), (0, 1, 2, 3), (6, 7, 8, 9),
                                        tuple(range(12))]
    assert tiles(8, (2, 4)) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]   # one node: aligned
    assert communicator_bound((1, 3, 6, 12), [(1, 3), (2, 3), (6, 2)]) == 3 + 2 + 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert GroupPool().gpus_per_node == 8                       # a world of one in a node of 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(PlanError, match="LOCAL_WORLD_SIZE='eight' is not a whole number"):
        GroupPool()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(PlanError, match=r"pool degrees \[3\] have no tile \(world size 1, nodes of 1 GPUs\)"):
        GroupPool(degrees=(3,))
    with pytest.raises(PlanError, match="gpus_per_node must be a whole number >= 1"):
        GroupPool(gpus_per_node=0)
    with pytest.raises(PlanError, match="the cluster has 8 GPUs but the process group has 1 ranks"):
        from flexsp import Cluster
        GroupPool(cluster=Cluster(num_gpus=8, gpus_per_node=8))
    with pytest.raises(PlanError, match="heads must be a whole number"):
        GroupPool(heads=0)
