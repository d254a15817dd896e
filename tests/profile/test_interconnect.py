"""Interconnect presets fill what a profile could not measure, keep what it did, and say so."""
import pytest

from flexsp import CostModel, CostModelError
from flexsp.plan.analytic import alltoall_bandwidth, analytic_cost_model
from flexsp.plan.cost import describe_sources
from flexsp.plan.specs import get_model
from flexsp.profile.interconnect import INTERCONNECTS, with_interconnect


def measured(bandwidths):
    return CostModel(alpha1=1e-10, alpha2=1e-5, beta1=0.01, comm_bytes_per_token=1e4, alltoall_bandwidth=bandwidths,
                     token_capacity=5000, meta={"source": "flexsp profile", "estimates": [],
                                                "comm": {"fits": {str(d): {} for d in bandwidths}}})


@pytest.mark.parametrize("name", sorted(INTERCONNECTS))
def test_fills_unmeasured_degrees_from_the_preset_and_keeps_measured_ones(name):
    spec = get_model("llama-7b")
    preset = INTERCONNECTS[name]
    cost = with_interconnect(measured({2: 1.5e9, 4: 1.0e9}), spec, name, 2, up_to=1024)
    assert sorted(cost.alltoall_bandwidth) == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert cost.alltoall_bandwidth[2] == 1.5e9 and cost.alltoall_bandwidth[4] == 1.0e9      # measured wins
    assert cost.alltoall_bandwidth[64] == alltoall_bandwidth(64, 8, preset.intra_node_bandwidth,
                                                             preset.inter_node_bandwidth)
    assert cost.meta["assumed"]["degrees"] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert cost.heads == spec.heads and cost.ring_hop_latency == 3 * spec.softmax_layers * preset.latency
    assert cost.seq_time(100_000, 1024) > 0                                  # ring hybrid beyond 32 heads
    line = describe_sources(cost)
    assert "measured compute" in line and "all-to-all at degrees [2, 4]" in line and name in line
    assert CostModel.from_dict(cost.to_dict()) == cost


def test_unknown_preset_is_named():
    with pytest.raises(CostModelError, match="unknown interconnect 'ib'; choose one of nvlink-ib"):
        with_interconnect(measured({}), get_model("llama-7b"), "ib", 2)


def test_a_measured_ring_axis_is_kept_and_only_the_all_to_all_is_assumed():
    spec = get_model("llama-7b")
    ring = dict(CostModel.to_dict(measured({2: 1.5e9})), heads=spec.heads, kv_heads=spec.kv_heads,
                ring_bytes_per_token=123.0, ring_bandwidth=3e9, ring_hop_latency=7e-4)
    ring["meta"] = dict(ring["meta"], ring={"measured": True, "ring": 4, "link": "intra-node"})
    cost = with_interconnect(CostModel.from_dict(ring), spec, "pcie", 2, up_to=64)
    assert (cost.ring_bandwidth, cost.ring_hop_latency, cost.ring_bytes_per_token) == (3e9, 7e-4, 123.0)
    assert cost.meta["assumed"]["parts"] == ["alltoall_bandwidth"] and cost.alltoall_bandwidth[2] == 1.5e9
    line = describe_sources(cost)
    measured_part, assumed_part = line.split("; assumed ")
    assert "ring bandwidth and hop latency (rings of 4, intra-node)" in measured_part
    assert "all-to-all at degrees 4..64 from the pcie preset" in assumed_part and "ring" not in assumed_part
    unmeasured = with_interconnect(measured({2: 1.5e9}), spec, "pcie", 2, up_to=64)   # no ring fit: the preset's
    assert unmeasured.ring_bandwidth == INTERCONNECTS["pcie"].inter_node_bandwidth
    assert "ring bandwidth and hop latency from the pcie preset" in describe_sources(unmeasured)


@pytest.mark.parametrize("name", ["qwen3.5-27b", "gpt-oss-20b", "gemma-3-27b", "llama3-8b"])
def test_filled_axes_are_the_analytic_models(name):
    """A profile's filled-in axes follow the model as the analytic model does: the heads every mixer splits by
    (Qwen3.5: 8, not its 24 attention heads), the ring latency of the softmax layers only, no ring axis for
    linear-attention layers (their recurrences cannot run on one), and the heads copied past the kv heads."""
    spec = get_model(name)
    cost = with_interconnect(measured({2: 1.5e9}), spec, "nvlink-ib", 2, up_to=64)
    analytic = analytic_cost_model(spec, "h100-80gb", num_gpus=64)
    assert (cost.heads, cost.kv_heads) == (analytic.heads, analytic.kv_heads)
    assert (cost.ring_bandwidth is None) == (analytic.ring_bandwidth is None) == bool(spec.mixer_layers("linear"))
    assert cost.ring_bytes_per_token == analytic.ring_bytes_per_token
    assert cost.ring_hop_latency == 3 * spec.softmax_layers * INTERCONNECTS["nvlink-ib"].latency * (cost.ring_bandwidth is not None)
    common = set(cost.alltoall_bandwidth) & set(analytic.alltoall_bandwidth)
    assert {u: cost.alltoall_bytes(u) / cost.comm_bytes_per_token for u in common} == pytest.approx(
        {u: analytic.alltoall_bytes(u) / analytic.comm_bytes_per_token for u in common})
    assert ("ring_bandwidth" in cost.meta["assumed"]["parts"]) == (cost.ring_bandwidth is not None)
