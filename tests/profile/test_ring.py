"""The ring axis measured: one hop around the pool's rings (gloo, CPU), its fit, and the cost model it gives."""
import dataclasses
import json

import numpy as np
import pytest

from flexsp import CostModel, CostModelError
from flexsp.plan.cost import describe_sources
from flexsp.profile import fit_bandwidth, model_spec

torch = pytest.importorskip("torch")

from runtime.distributed import run_distributed  # noqa: E402  (tests/ is on sys.path, see conftest.py)

RING_SIZES = [16, 2**16, 2**20, 2**22]   # a tiny message shows the latency, 4 MiB the bandwidth


def test_fit_recovers_a_known_latency_and_bandwidth():
    latency, bandwidth = 30e-6, 2.5e9
    sizes = np.repeat([16, 4096, 2**16, 2**20, 2**24], 3)
    noise = np.tile([1.0, 1.02, 0.99], 5)            # repeats: the median is the clean time
    fit = fit_bandwidth(2, sizes, (latency + sizes / bandwidth) * noise, what="ring")
    assert fit.latency == pytest.approx(latency, rel=1e-6) and fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.max_abs_error < 1e-9
    with pytest.raises(CostModelError, match="ring fit for degree 2 needs at least 3 distinct message sizes"):
        fit_bandwidth(2, [16, 1024], [1e-5, 2e-5], what="ring")


def test_ring_layout_follows_the_pools_tiles_and_the_runtimes_rings():
    from flexsp.profile.ring import ring_layout
    from flexsp.runtime.pool import tiles
    one_node = ring_layout(4, (1, 2, 4), 4)
    assert (one_node.degree, one_node.stride, one_node.rings, one_node.link) == (4, 1, ((0, 1, 2, 3),), "intra-node")
    nodes = ring_layout(16, (1, 2, 4, 8, 16), 8)   # across nodes: stride one node, every hop crosses
    assert (nodes.size, nodes.link) == (2, "inter-node") and nodes.rings == tuple((j, j + 8) for j in range(8))
    partial = ring_layout(6, (1, 2, 4), 6)          # ranks 4 and 5 are in no tile of 4 and sit out
    assert partial.rings == ((0, 1, 2, 3),) and partial.rings[0] in tiles(6, [4], 6)
    assert nodes.to_dict()["tiles"] == [[0, 15]] and nodes.to_dict(listed=4).get("rings") is None
    assert ring_layout(1, (1,), 1) is None


def _sweep_worker(rank, world_size, gpus_per_node):
    from flexsp.profile.compute import DeviceSetup
    from flexsp.profile.ring import ring_sweep
    from flexsp.runtime.pool import GroupPool
    layout, samples = ring_sweep(GroupPool(gpus_per_node=gpus_per_node), DeviceSetup.resolve("cpu"), RING_SIZES,
                                 repeats=3, warmup=1)
    return layout.to_dict(), [(s.ring, s.payload_bytes, s.seconds) for s in samples]


def test_ring_sweep_gives_every_rank_the_same_samples_and_a_positive_fit():
    """4 ranks as two nodes of 2: rings (0, 2) and (1, 3), every hop crossing the node boundary."""
    results = run_distributed(_sweep_worker, 4, 2)
    assert all(r == results[0] for r in results)          # the slowest rank's times, on every rank
    layout, samples = results[0]
    assert layout["rings"] == [[0, 2], [1, 3]] and layout["link"] == "inter-node"
    assert sorted({b for _, b, _ in samples}) == RING_SIZES and len(samples) == 3 * len(RING_SIZES)
    assert {r for r, _, _ in samples} == {2} and all(t > 0 for _, _, t in samples)
    fit = fit_bandwidth(2, [b for _, b, _ in samples], [t for _, _, t in samples], statistic="min", what="ring")
    assert fit.latency > 0 and fit.bandwidth > 0


def _profile_worker(rank, world_size, out):
    from flexsp.profile.cli import main
    return main(["profile", "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
                 "--vocab", "64", "--lengths", "32,64,128,256", "--repeats", "2", "--warmup", "1", "--clock", "cpu",
                 "--statistic", "min", "--comm-sizes", "256K,4M,16M", "--ring-sizes", ",".join(map(str, RING_SIZES)),
                 "--memory-gb", "1", "--threads", "1", "--interconnect", "nvlink-ib", "--quiet", "--force", "-o", out])


def test_profile_measures_the_ring_axis_and_plans_ring_groups_from_it(tmp_path):
    """2 heads on 4 ranks: degree 4 is Ulysses 2 x ring 2, costed from the measured ring, not the preset."""
    out = tmp_path / "cost.json"
    assert run_distributed(_profile_worker, 4, str(out), timeout=90) == [0] * 4
    cost = CostModel.load(out)
    ring = cost.meta["ring"]
    assert ring["measured"] and ring["rings"] == [[0, 1, 2, 3]] and ring["link"] == "intra-node"
    fit = ring["fit"]
    assert fit["latency"] > 0 and fit["bandwidth"] > 0
    spec = model_spec("tiny", layers=2, hidden=32, heads=2, kv_heads=1, ffn=64, vocab=64)
    assert cost.ring_bandwidth == fit["bandwidth"] != 40e9                      # kept over the preset's
    assert cost.ring_hop_latency == pytest.approx(3 * 2 * fit["latency"])     # 3 passes x 2 layers
    assert cost.ring_bytes_per_token == 3 * 2 * 2 * spec.kv_dim * 4           # fp32 on CPU
    assert (cost.heads, cost.kv_heads, cost.split(4)) == (2, 1, (2, 2))
    assert cost.meta["assumed"]["parts"] == ["alltoall_bandwidth"]
    assert cost.alltoall_bandwidth[4] == cost.meta["comm"]["fits"]["4"]["bandwidth"]   # measured all-to-all kept
    line = describe_sources(cost)
    assert "measured" in line and "ring bandwidth and hop latency (rings of 4, intra-node)" in line.split("assumed")[0]
    assert "ring" not in line.split("assumed")[1]

    import flexsp
    small = dataclasses.replace(cost, token_capacity=300)   # 1,000 tokens need 4 GPUs: 250 each
    lengths = np.array([1000, 40, 60])
    plan = flexsp.plan_batch(lengths, small, flexsp.Cluster(4, 4), "flexsp", time_limit=0.5)
    plan.validate(lengths=lengths, cost=small)
    ringed = [g for mb in plan.micro_batches for g in mb.groups if 0 in g.seq_ids]
    assert [(g.degree, g.ring) for g in ringed] == [(4, 2)]
    assert small.ring_hops(4) == small.ring_hop_latency > 0      # a ring of 2 makes one hop per pass and layer
    small.save(tmp_path / "small.json")
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    from flexsp.cli import main
    assert main(["plan", str(tmp_path / "lengths.txt"), "--cost", str(tmp_path / "small.json"), "--gpus", "4",
                 "--time-limit", "0.5", "-o", str(tmp_path / "plan.json")]) == 0
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert any(g.get("ring", 1) == 2 for mb in saved["micro_batches"] for g in mb["groups"])
