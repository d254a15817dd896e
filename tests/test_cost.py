import json
import math

import numpy as np
import pytest

import flexsp
from flexsp.plan.analytic import alltoall_bandwidth, analytic_cost_model
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.specs import GPUSpec, ModelSpec

CONTRACT = dict(alpha1=5.128e-9, alpha2=1.839576e-4, beta1=0.6293563, comm_bytes_per_token=4 * 2 * 32 * 4096 * 2,
                alltoall_bandwidth={2: 1.25e11, 4: 1.09e11, 8: 1.01e11, 16: 1.08e10, 32: 6.2e9, 64: 5.1e9},
                token_capacity=6407)


def test_seq_and_group_time_follow_the_paper_formula():
    cost = flexsp.CostModel(**CONTRACT)
    s, d = 10_000, 16
    expected = (5.128e-9 * s * s + 1.839576e-4 * s) / d + CONTRACT["comm_bytes_per_token"] * s / d / 1.08e10
    assert cost.seq_time(s, d) == pytest.approx(expected, rel=1e-12)
    assert cost.seq_time(s, 1) == pytest.approx(5.128e-9 * s * s + 1.839576e-4 * s)
    assert cost.group_time([s, 2 * s], d) == pytest.approx(cost.seq_time(s, d) + cost.seq_time(2 * s, d) + 0.6293563)
    np.testing.assert_allclose(cost.seq_time(np.array([1, s]), d), [cost.seq_time(1, d), cost.seq_time(s, d)])


def test_capacity_check():
    cost = flexsp.CostModel(**CONTRACT)
    assert cost.fits([6407], 1) and not cost.fits([6408], 1)
    assert cost.fits([6000, 6000], 2) and not cost.fits([7000, 7000], 2)
    assert cost.min_degree(6407) == 1 and cost.min_degree(6408) == 2 and cost.min_degree(384 * 1024) == 64


def test_paper_preset_matches_published_constants():
    cost = cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    assert cost.token_capacity == 6407                         # (30 GB - 7.85B x 16 B / 64) / 4.48 MB
    assert cost.alpha1 == pytest.approx(5.128e-9) and cost.beta1 == pytest.approx(0.6293563)
    assert cost.alltoall_bandwidth[16] == pytest.approx(10.33 * 2**20 * 1000)
    assert cost.comm_bytes_per_token == CONTRACT["comm_bytes_per_token"]
    big = cost_from_preset("gpt-30b", context=192 * 1024, num_gpus=64)
    assert big.token_capacity == math.floor((30 * 1024 - 31.53 * 16 / 64 * 1024) / 3.417381836)
    with pytest.raises(flexsp.CostModelError, match="unknown preset"):
        cost_from_preset("gpt-1t")


def test_analytic_model_is_close_to_the_paper_for_gpt7b_shapes():
    model = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)
    gpu = GPUSpec(peak_flops=312e12, memory_bytes=40 * 2**30, intra_node_bandwidth=90e9, inter_node_bandwidth=6.25e9)
    cost = analytic_cost_model(model, gpu, num_gpus=64)
    assert cost.alpha1 == pytest.approx(3 * 32 * 2 * 4096 / (312e12 * 0.5))
    assert cost.alpha1 == pytest.approx(5.128e-9, rel=0.05)    # the paper's fitted value
    assert cost.comm_bytes_per_token == 2 * 32 * 4 * 4096 * 2  # = the contract's 4 a2a x fwd/bwd x layers x hidden x 2
    assert set(cost.alltoall_bandwidth) == {2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64}   # every degree with a tile
    # inside a node: payload (d-1)/d over NVLink; across: (d-g)/d over the NIC
    assert alltoall_bandwidth(8, 8, 90e9, 6.25e9) == pytest.approx(90e9 * 8 / 7)
    assert alltoall_bandwidth(64, 8, 90e9, 6.25e9) == pytest.approx(64 * 6.25e9 / 56)
    gqa = analytic_cost_model(ModelSpec(32, 4096, 32, 8, 14336, 128256), gpu, num_gpus=64)
    assert gqa.comm_bytes_per_token == 2 * 32 * (2 * 4096 + 2 * 1024) * 2


@pytest.mark.parametrize("change, message", [
    ({"alpha1": -1.0}, "alpha1 must be >= 0"),
    ({"alpha1": float("inf")}, "alpha1 must be finite"),
    ({"beta1": None}, "beta1 is missing"),
    ({"token_capacity": 0}, "token_capacity must be >= 1"),
    ({"alpha2": "fast"}, "alpha2 must be a number"),
    ({"alltoall_bandwidth": {0: 1e9}}, "degree 0, which is not an SP degree"),
    ({"alltoall_bandwidth": {2: -5}}, r"alltoall_bandwidth\[2\] must be > 0"),
])
def test_bad_coefficients_are_named(change, message):
    with pytest.raises(flexsp.CostModelError, match=message):
        flexsp.CostModel(**{**CONTRACT, **change})


def test_missing_bandwidth_names_the_degree():
    cost = flexsp.CostModel(**{**CONTRACT, "alltoall_bandwidth": {2: 1e11, 4: 1e11}})
    with pytest.raises(flexsp.CostModelError, match="no all-to-all bandwidth for SP degree 8"):
        cost.seq_time(100, 8)
    with pytest.raises(flexsp.CostModelError, match="degree 8"):
        flexsp.plan_batch([100, 200], cost, flexsp.Cluster(8))


def test_json_round_trip_is_exact(tmp_path):
    cost = cost_from_preset("gpt-13b", context=192 * 1024)
    path = tmp_path / "cost.json"
    cost.save(path)
    again = flexsp.CostModel.load(path)
    assert again == cost and again.meta == cost.meta
    data = json.loads(path.read_text())
    del data["alpha2"]
    with pytest.raises(flexsp.CostModelError, match="missing alpha2"):
        flexsp.CostModel.from_dict(data)
    path.write_text("{not json")
    with pytest.raises(flexsp.CostModelError, match="not valid JSON"):
        flexsp.CostModel.load(path)


def hybrid_model(**change) -> flexsp.CostModel:
    return flexsp.CostModel(**{**CONTRACT, "heads": 8, "kv_heads": 2, "ring_bytes_per_token": 3 * 32 * 2 * 1024 * 2,
                               "ring_bandwidth": 5e9, **change})


def test_hybrid_ulysses_ring_matches_hand_computed_values():
    cost = hybrid_model()
    assert cost.ulysses_limit == 8 and cost.split(8) == (8, 1) and cost.split(64) == (8, 8)
    ring_bytes = 3 * 32 * 2 * 1024 * 2
    for s, d in [(100_000, 64), (2_000_000, 64), (300_000, 16)]:
        u, r = cost.split(d)
        compute = 5.128e-9 * s * s / d
        ring = ring_bytes * s * (r - 1) / (r * min(u, 2)) / 5e9     # each rank holds 1/2 of the KV width
        expected = 1.839576e-4 * s / d + CONTRACT["comm_bytes_per_token"] * s / d / CONTRACT["alltoall_bandwidth"][u] \
            + max(compute, ring)
        assert cost.seq_time(s, d) == pytest.approx(expected, rel=1e-12)
    # both regimes of the overlap occur: short sequences wait on KV passing, long ones compute
    ring_per_token = ring_bytes * 7 / (8 * 2) / 5e9
    assert ring_per_token * 200 > 5.128e-9 * 200 ** 2 / 64
    assert ring_per_token * 2_000_000 < 5.128e-9 * 2_000_000 ** 2 / 64
    for s in (200, 2_000_000):
        assert cost.seq_time(s, 64) == pytest.approx(
            1.839576e-4 * s / 64 + CONTRACT["comm_bytes_per_token"] * s / 64 / CONTRACT["alltoall_bandwidth"][8]
            + max(5.128e-9 * s * s / 64, ring_per_token * s), rel=1e-12)
    # within the limit nothing changes
    plain = flexsp.CostModel(**CONTRACT)
    assert cost.seq_time(50_000, 8) == pytest.approx(plain.seq_time(50_000, 8))


def test_hybrid_needs_ring_bandwidth_and_round_trips():
    with pytest.raises(flexsp.CostModelError, match="exceeds the Ulysses limit of 8"):
        hybrid_model(ring_bandwidth=None).seq_time(1000, 16)
    with pytest.raises(flexsp.CostModelError, match="multiple of kv_heads"):
        hybrid_model(heads=6, kv_heads=4)
    cost = hybrid_model(heads=40)                                   # 40 heads: Ulysses limit 8
    assert cost.ulysses_limit == 8
    assert flexsp.CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_plans_record_the_split_and_can_stay_within_the_ulysses_limit():
    cost = hybrid_model(token_capacity=4000)
    cluster = flexsp.Cluster(64, 8)
    lengths = [200_000, 3000, 1500, 800]                            # 200K needs 64 GPUs of memory
    plan = flexsp.plan_batch(lengths, cost, cluster)
    big = [g for mb in plan.micro_batches for g in mb.groups if g.degree > 8]
    assert big and all(g.ring == g.degree // 8 and g.ulysses == 8 for g in big)
    assert flexsp.Plan.from_json(plan.to_json()) == plan
    small = flexsp.plan_batch([20_000, 3000, 1500, 800], cost, cluster, ulysses_only=True)
    assert max(g.degree for mb in small.micro_batches for g in mb.groups) <= 8
    with pytest.raises(flexsp.PlanError, match="more than the whole cluster can hold.*largest allowed degree"):
        flexsp.plan_batch(lengths, cost, cluster, ulysses_only=True)


def test_analytic_model_knows_its_heads():
    cost = analytic_cost_model("llama3-8b", "h100-80gb", num_gpus=16384)
    assert cost.heads == 32 and cost.kv_heads == 8 and cost.ulysses_limit == 32
    assert max(cost.alltoall_bandwidth) == 16384
    assert cost.seq_time(2_000_000, 512) > 0 and cost.split(512) == (32, 16)


def test_ring_hop_latency_adds_r_minus_1_hops_inside_the_overlap():
    latency = 2e-3
    cost = hybrid_model(ring_hop_latency=latency)
    plain = hybrid_model()
    ring_bytes = 3 * 32 * 2 * 1024 * 2
    for s, d in [(200, 64), (100_000, 64), (2_000_000, 64), (300_000, 16)]:
        u, r = cost.split(d)
        compute = 5.128e-9 * s * s / d
        ring = ring_bytes * s * (r - 1) / (r * min(u, 2)) / 5e9 + (r - 1) * latency
        expected = 1.839576e-4 * s / d + CONTRACT["comm_bytes_per_token"] * s / d / CONTRACT["alltoall_bandwidth"][u] \
            + max(compute, ring)
        assert cost.seq_time(s, d) == pytest.approx(expected, rel=1e-12)
        assert cost.seq_time(s, d) >= plain.seq_time(s, d)
    assert cost.seq_time(50_000, 8) == plain.seq_time(50_000, 8)          # no ring axis, no hops
    # a short sequence now pays the hops: 7 hops at 2 ms on a ring of 8
    assert cost.seq_time(200, 64) - plain.seq_time(200, 64) == pytest.approx(7 * latency, rel=1e-6)
    # the solver's per-degree view and Plan.time agree with seq_time
    costs = cost.degree_costs((1, 2, 4, 8, 16, 32, 64))
    assert float(costs.seconds(np.array([200.0]), costs.index(64))[0]) == pytest.approx(cost.seq_time(200, 64))
    # JSON: written when set, absent (old files) means 0
    assert flexsp.CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert "ring_hop_latency" not in plain.to_dict()
    with pytest.raises(flexsp.CostModelError, match="ring_hop_latency"):
        hybrid_model(ring_hop_latency=-1.0)


def test_plans_and_bounds_with_ring_hop_latency():
    from flexsp.plan.bounds import coupled_lower_bound
    cost = hybrid_model(token_capacity=4000, ring_hop_latency=5e-3)
    cluster = flexsp.Cluster(64, 8)
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[200_000, 120_000], rng.integers(100, 4000, size=60)])
    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=30)
    plan.validate(lengths, cost, cluster)               # predicted_time is recomputed with the hops
    assert plan.predicted_time == pytest.approx(plan.time(lengths, cost))
    assert coupled_lower_bound(lengths, cost, cluster) <= plan.predicted_time * (1 + 1e-9)


def test_alltoall_replication_scales_the_volume_where_heads_are_copied(tmp_path):
    """``alltoall_replication[u]``: at Ulysses degree u the runtime copies kv heads, so more bytes move; a model
    without it (an older JSON file) means what it did, and bad entries are one-line errors."""
    plain = hybrid_model()
    copied = hybrid_model(alltoall_replication={4: 1.25, "8": 1.75})
    assert copied.alltoall_replication == {4: 1.25, 8: 1.75} and plain.alltoall_replication == {}
    for d, factor in ((2, 1.0), (4, 1.25), (8, 1.75), (64, 1.75)):     # 64 = 8 x ring 8: its Ulysses part's
        u = copied.split(d)[0]
        comm = CONTRACT["comm_bytes_per_token"] * factor / CONTRACT["alltoall_bandwidth"][u] / d
        assert copied.coefficients(d)[1] - plain.coefficients(d)[1] == pytest.approx(comm - comm / factor)
    path = tmp_path / "cost.json"
    copied.save(path)
    assert flexsp.CostModel.load(path) == copied
    assert "alltoall_replication" not in plain.to_dict()
    # the planner's predicted time is the independent validator's, replication included
    from validator import check_plan
    lengths = [300_000, 120_000, 40_000, 9_000, 3_000, 800]
    plan = flexsp.plan_batch(lengths, copied, flexsp.Cluster(64, 8))
    assert any(copied.split(g.degree)[0] in (4, 8) for mb in plan.micro_batches for g in mb.groups)
    assert check_plan(plan.to_dict(), lengths, copied, 64, 8) == pytest.approx(plan.predicted_time, rel=1e-9)
    for bad, match in (({1: 2.0}, "Ulysses degree 2 to"), ({4: 0.5}, r"\(1 to 2\*\*20\)"), ({4: "x"}, "alltoall_replication"),
                       ([1.5], "must map a Ulysses degree")):
        with pytest.raises(flexsp.CostModelError, match=match):
            hybrid_model(alltoall_replication=bad)


@pytest.mark.parametrize("meta", [
    {"source": "flexsp profile", "estimates": 5}, {"source": "flexsp profile", "estimates": [1, 2]},
    {"source": "flexsp profile", "comm": "x"}, {"source": "flexsp profile", "comm": {"fits": {"a": 1}}},
    {"source": "flexsp profile", "ring": [1]}, {"source": "flexsp profile", "assumed": {"x": 1}},
    {"source": "analytic", "model": {"layer_kinds": {"full": 1}, "active_params": "x", "params": "y"}}])
def test_a_cost_files_malformed_provenance_is_said_not_raised(meta, tmp_path, capsys):
    """``meta`` is free-form provenance from an untrusted file: ``flexsp simulate`` prints it after simulating,
    so a field of the wrong shape must not throw the run (and its --json) away."""
    from flexsp.cli import main
    from flexsp.plan.cost import describe_sources
    cost = flexsp.CostModel(**{**CONTRACT, "meta": meta})
    assert describe_sources(cost) == "cost model parts: provenance unreadable (a field of the file's meta has the wrong shape)"
    cost.save(tmp_path / "cost.json")
    assert main(["simulate", "--cost", str(tmp_path / "cost.json"), "--gpus", "8", "--steps", "1", "--batch-size", "8",
                 "--strategies", "flexsp", "--context", "32K", "--quiet", "--json", str(tmp_path / "sim.json")]) == 0
    assert "provenance unreadable" in capsys.readouterr().out and (tmp_path / "sim.json").is_file()


def test_ring_message_is_the_kv_width_over_gcd_of_ulysses_and_kv_heads():
    """40 heads, 8 kv heads, a group of 60 = Ulysses 20 x ring 3: the runtime copies each kv head 20 / gcd(8, 20) = 5
    times and splits the 40 copies over 20 ranks, so a rank's K/V message is 2 of the 8 kv heads: a quarter of
    the width (min(u, kv_heads) = 8 would cost an eighth)."""
    cost = hybrid_model(heads=40, kv_heads=8, alltoall_bandwidth={**CONTRACT["alltoall_bandwidth"], 20: 1e11})
    assert cost.split(60) == (20, 3)
    ring = 3 * 32 * 2 * 1024 * 2 * (3 - 1) / (3 * 4) / 5e9
    assert cost.coefficients(60)[2] == pytest.approx(ring, rel=1e-12)
