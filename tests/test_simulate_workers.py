"""``simulate`` / ``flexsp simulate --workers K``: steps planned in parallel processes give the same
plans as one process (the serial run is the reference)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import flexsp
from flexsp.errors import FlexSPError, PlanError
from flexsp.evaluation.simulate import plan_steps, simulate
from flexsp.plan.lengths import get_distribution

ROOT = Path(__file__).resolve().parents[1]
# a small setting whose solves finish far inside the time limit, so it never binds
SETTING = dict(steps=4, batch_size=48, context=64 * 1024, config=flexsp.PlanConfig(time_limit=20.0), progress=False)
STRATEGIES = ["flexsp", "greedy", "batchada", "dynamic-cp", "static:16", "static:1"]


def _same(a, b) -> None:
    assert a.lower_bounds == b.lower_bounds and (a.first_batch == b.first_batch).all()
    for name in STRATEGIES:
        ra, rb = a.runs[name], b.runs[name]
        assert (ra.step_times, ra.micro_batches, ra.degrees, ra.error) == \
            (rb.step_times, rb.micro_batches, rb.degrees, rb.error), name
        assert (ra.first_plan is None) == (rb.first_plan is None)
        if ra.first_plan is not None:
            assert ra.first_plan.micro_batches == rb.first_plan.micro_batches


def test_workers_give_the_serial_results():
    cost = flexsp.cost_from_preset("gpt-7b", context=64 * 1024, num_gpus=16)
    cluster = flexsp.Cluster(16, 8)
    dist = get_distribution("wikipedia")
    serial = simulate(dist, cost, cluster, STRATEGIES, workers=1, **SETTING)
    parallel = simulate(dist, cost, cluster, STRATEGIES, workers=2, **SETTING)
    _same(serial, parallel)
    assert serial.runs["static:1"].error   # a 1-GPU group cannot hold the long ones: an error, not a crash


def test_bad_workers_and_unrestricted_failures_are_named():
    cost = flexsp.cost_from_preset("gpt-7b", context=64 * 1024, num_gpus=16)
    with pytest.raises(FlexSPError, match="workers must be >= 1"):
        list(plan_steps([[10]], cost, flexsp.Cluster(16), ["flexsp"], workers=0))
    with pytest.raises(PlanError, match="unknown strategy"):
        simulate(get_distribution("wikipedia"), cost, flexsp.Cluster(16), ["nope"], workers=2, **SETTING)


def test_cli_workers_flag(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "flexsp", "simulate", "--gpus", "16", "--context", "64K", "--steps", "3",
           "--batch-size", "32", "--strategies", "greedy,dynamic-cp", "--quiet", "--json", str(out)]
    serial = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert serial.returncode == 0, serial.stderr[-2000:]
    first = json.loads(out.read_text())
    parallel = subprocess.run(cmd + ["--workers", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    second = json.loads(out.read_text())
    for name in ("greedy", "dynamic-cp"):
        for key in ("step_times", "micro_batches", "degree_histogram", "total_time"):
            assert first["strategies"][name][key] == second["strategies"][name][key]
