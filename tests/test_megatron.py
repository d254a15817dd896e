"""The Megatron-style baseline (flexsp/evaluation/megatron.py) against values computed by hand."""
import math

import numpy as np
import pytest

import flexsp
from flexsp import CostModel
from flexsp.errors import CostModelError, PlanError
from flexsp.evaluation.megatron import MegatronModel, megatron_step_time, step_for_cp
from flexsp.plan.presets import cost_from_preset


def small_model(**overrides) -> MegatronModel:
    params = dict(alpha1=1e-8, alpha2=1e-4, beta1=0.5, hidden=1024, layers=2, token_capacity=1000,
                  intra_node_bandwidth=1e11, inter_node_bandwidth=1e9, tp=8, gpus_per_node=8)
    params.update(overrides)
    return MegatronModel(**params)


def test_tp_only_sequence_time():
    m = small_model()
    s = 8000
    # compute: (1e-8 * 8000^2 + 1e-4 * 8000) / 8 = (0.64 + 0.8) / 8 = 0.18
    # TP: 4 all-reduces x 2 layers x 2*(7/8) x 8000 tokens x 1024 x 2 bytes / 1e11 = 2.29376e-3
    assert m.seq_time(s, 1) == pytest.approx(0.18 + 2.29376e-3, rel=1e-12)
    parts = m.breakdown(s, 1)
    assert parts["ring_comm_exposed"] == pytest.approx(0.0)


def test_ring_attention_comm_bound():
    m = small_model()
    s = 8000   # cp=2: 16 GPUs, spans two nodes -> inter-node 1e9 B/s
    linear = 1e-4 * s / 16                                  # 0.05
    attention = 1e-8 * s * s / 16                           # 0.04
    tp = 4 * 2 * 2 * 7 / 8 * (s / 2) * 1024 * 2 / 1e11     # 1.14688e-3
    step_compute = attention / 2                            # 0.02
    step_comm = 3 * 2 * 2 * (1024 / 8) * (s / 2) * 2 / 1e9  # 0.012288 -> compute-bound
    assert step_comm < step_compute
    assert m.seq_time(s, 2) == pytest.approx(linear + tp + step_compute + max(step_compute, step_comm), rel=1e-12)
    # a short sequence is communication-bound: the exposed ring time is (cp-1) x (comm - compute)
    s = 1000
    step_compute = 1e-8 * s * s / 16 / 2
    step_comm = 3 * 2 * 2 * 128 * (s / 2) * 2 / 1e9
    assert step_comm > step_compute
    parts = m.breakdown(s, 2)
    assert parts["ring_comm_exposed"] == pytest.approx(step_comm - step_compute, rel=1e-12)
    assert parts["attention"] == pytest.approx(step_compute + step_comm, rel=1e-12)


def test_intra_node_cp_uses_nvlink():
    m = small_model(tp=2)   # tp=2, cp=4 -> 8 GPUs in one node
    assert m.cp_bandwidth(4) == 1e11
    assert m.cp_bandwidth(8) == 1e9


def test_step_packs_and_balances():
    m = small_model()
    # 16 GPUs, cp=1: 2 replicas of 8 GPUs, 8000 tokens per micro-batch each.
    lengths = np.array([6000, 6000, 2000, 2000])
    time, packs = step_for_cp(lengths, m, 16, 1)
    # LPT: 6000 -> r0, 6000 -> r1, 2000 -> r0 (8000 tokens, still one pack), 2000 -> r1
    t6, t2 = m.seq_time(6000, 1), m.seq_time(2000, 1)
    assert packs == (1, 1)
    assert time == pytest.approx(t6 + t2 + 0.5, rel=1e-12)
    # a sequence longer than one replica forces cp=2 (a single replica of 16 GPUs)
    step = megatron_step_time([9000, 1000], m, 16)
    assert step.cp == 2 and step.replicas == 1
    assert step.times_by_cp[1] == math.inf
    assert step.time == pytest.approx(m.seq_time(9000, 2) + m.seq_time(1000, 2) + 0.5, rel=1e-12)
    assert step.micro_batches == (1,)


def test_step_counts_micro_batches_by_memory():
    m = small_model()
    # one replica (8 GPUs) holding 8000 tokens per micro-batch: 3 x 5000 tokens -> 3 packs
    time, packs = step_for_cp(np.array([5000, 5000, 5000]), m, 8, 1)
    assert packs == (3,)
    assert time == pytest.approx(3 * m.seq_time(5000, 1) + 3 * 0.5, rel=1e-12)


def test_best_cp_is_chosen_and_pinned_cp_respected():
    m = small_model()
    lengths = [4000] * 8
    step = megatron_step_time(lengths, m, 32)
    assert step.time == min(step.times_by_cp.values())
    pinned = megatron_step_time(lengths, m, 32, cp=4)
    assert pinned.cp == 4 and pinned.time == pytest.approx(step.times_by_cp[4])
    with pytest.raises(PlanError):
        megatron_step_time(lengths, m, 32, cp=8)     # 64 GPUs > 32
    with pytest.raises(PlanError):
        megatron_step_time([10**6], m, 32)           # fits no replica


def test_from_preset_uses_paper_constants():
    m = MegatronModel.from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    cost = cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    assert (m.alpha1, m.alpha2, m.beta1, m.token_capacity) == (cost.alpha1, cost.alpha2, cost.beta1, cost.token_capacity)
    assert (m.hidden, m.layers) == (4096, 32)
    assert m.intra_node_bandwidth == cost.alltoall_bandwidth[8]


def test_bad_inputs():
    with pytest.raises(CostModelError):
        small_model(hidden=1001)
    with pytest.raises(CostModelError):
        small_model(inter_node_bandwidth=0)
    with pytest.raises(CostModelError):
        small_model().seq_time(100, 3)


def test_megatron_model_refuses_windowed_layers_it_would_cost_as_full():
    cost = flexsp.cost_from_hardware("gemma-3-27b", "h100-80gb", 64)
    with pytest.raises(flexsp.CostModelError, match="full attention.*window 1024"):
        MegatronModel.from_cost_model(cost, hidden=5376, layers=62)
