"""Device-time estimates of a replay (flexsp.replay.budget) and the measured share of a replayed step."""
import pytest

import flexsp
from flexsp.plan.specs import get_model
from flexsp.plan.types import Group, MicroBatch, Plan
from flexsp.replay.budget import BudgetClock, estimate_seconds, work_shares
from flexsp.replay.report import GroupReplay, ReplayReport

COST = flexsp.CostModel(alpha1=1e-9, alpha2=1e-4, beta1=0.05, comm_bytes_per_token=1e6, token_capacity=20_000,
                        alltoall_bandwidth={2: 1e11, 4: 1e11})


def test_work_shares_count_the_blocks_and_the_head_that_run():
    spec = get_model("llama3-8b")
    attention, linear = work_shares(spec, 2)
    assert attention == pytest.approx(2 / 32)
    head, layer = spec.hidden * spec.vocab, (spec.linear_params - spec.hidden * spec.vocab) / 32
    assert linear == pytest.approx((2 * layer + 2 * head) / (32 * layer + head))   # 2 blocks + the head twice
    assert 0.15 < linear < 0.25
    assert work_shares(spec, None) == work_shares(spec, 32) == (1.0, 1.0)


def test_estimate_counts_each_distinct_group_once_per_run():
    lengths = [1000, 1000, 4000, 200]
    plan = Plan(4, (MicroBatch((Group((0,), (0,)), Group((1,), (1,)), Group((2, 3), (2, 3)))),), predicted_time=0.0)
    spec = get_model("llama3-8b")
    attention, linear = work_shares(spec, 2)
    one = (attention * 1e-9 * 1000 ** 2 + linear * 1e-4 * 1000) + linear * 0.05          # groups 0 and 1: identical
    two = (attention * 1e-9 * (4000 ** 2 + 200 ** 2) + linear * 1e-4 * 4200) / 2 + linear * 0.05
    assert estimate_seconds(plan, lengths, COST, spec, 2, runs=4) == pytest.approx(4 * (one + two))


def test_budget_clock_corrects_by_what_it_measured():
    now = [0.0]
    clock = BudgetClock(100.0, started=0.0, clock=lambda: now[0])
    assert clock.fits(99.0) and not clock.fits(101.0)
    now[0] = 30.0
    clock.record(estimate=10.0, seconds=30.0)       # the device runs 3x slower than estimated
    assert clock.ratio == 3.0 and clock.expected(20.0) == 60.0
    assert clock.fits(23.0) and not clock.fits(24.0)


def test_measured_share_is_compute_over_the_critical_path():
    groups = (GroupReplay(0, 0, 2, 0, 1, 100, (0,), (3.0,), 3.0, 1.0, 3.5),     # critical in micro-batch 0
              GroupReplay(0, 1, 1, 2, 1, 50, (0,), (2.0,), 2.0, 0.0, 2.0),
              GroupReplay(1, 0, 1, 0, 1, 40, (0,), (4.0,), 4.0, 0.0, 4.0))
    report = ReplayReport(groups, 2, 4)
    assert report.measured_share == pytest.approx((3.0 + 4.0) / (4.0 + 4.0))
    assert report.to_dict()["step"]["measured_share"] == report.measured_share
