"""experiments/gpu_replay.py: the quick mode on CPU (plans with the measured preset, replays every plan, stops at
its budget and resumes), and the totals it compares."""
import json

import pytest

from scripts import experiment, run_script

STEM = "gpu_replay_h200-llama3-8b_8gpu"


def test_quick_mode_stops_at_its_budget_and_resumes(tmp_path, tree_unchanged):
    pytest.importorskip("torch")
    env = {"FLEXSP_QUICK_OUT": str(tmp_path)}
    first = run_script("gpu_replay", "--quick", "--quiet", "--budget", "0", env=env)
    assert "device-time budget" in first.stdout
    stopped = json.loads((tmp_path / f"{STEM}.json").read_text())
    assert stopped["replays"] == {} and "run the same command again" in stopped["stopped"]
    assert "**Incomplete**" in (tmp_path / f"{STEM}.md").read_text()

    second = run_script("gpu_replay", "--quick", "--quiet", env=env)
    assert "resuming" in second.stdout
    state = json.loads((tmp_path / f"{STEM}.json").read_text())
    assert state["steps"] == stopped["steps"]                       # the saved plans, not new ones
    assert state["stopped"] is None
    assert set(state["replays"]) == {f"0/{name}" for name in state["steps"][0]["plans"]}
    # what was measured on what: the replay's device, the preset's provenance and its assumed parts
    assert state["device"]["device_type"] == "cpu" and "measured compute on cpu" in state["device"]["label"]
    assert "NVIDIA H200" in state["cost_model"]["provenance"] and "nvlink-ib" in state["cost_model"]["parts"]["alltoall"]
    markdown = (tmp_path / f"{STEM}.md").read_text()
    assert "Quick mode" in markdown and "| flexsp | " in markdown and "measured share of replayed step" in markdown
    assert "1 of 1 step(s) replayed for every strategy" in markdown


def _state(replayed: dict) -> dict:
    plans = {"flexsp": {"predicted_time": 1.0}, "batchada": {"predicted_time": 1.5}}
    report = lambda t: {"step": {"replayed_time": t, "measured_share": 0.9}, "groups": [{"compute_error": -0.1}]}
    return {"setting": {"strategies": ["flexsp", "batchada", "static:8"]}, "replays": {k: report(v) for k, v in replayed.items()},
            "steps": [{"plans": plans, "errors": {"static:8": "too small"}}, {"plans": plans, "errors": {}}]}


def test_totals_compare_only_steps_every_strategy_replayed():
    module = experiment("gpu_replay")
    rows = {r["strategy"]: r for r in module.rows(_state({"0/flexsp": 2.0, "0/batchada": 4.0, "1/flexsp": 2.0}))}
    assert rows["flexsp"]["replayed"] == 2.0 and rows["batchada"]["replayed"] == 4.0      # step 1 is incomplete
    assert rows["batchada"]["speedup_replayed"] == 2.0 and rows["batchada"]["speedup_simulated"] == 1.5
    assert rows["flexsp"]["measured_share"] == pytest.approx(0.9)
    assert rows["static:8"]["error"] == "too small"
    planned_only = {r["strategy"]: r for r in module.rows(_state({}))}   # a dry run: simulated over every step
    assert planned_only["batchada"]["simulated"] == 3.0 and "replayed" not in planned_only["batchada"]


def test_a_plan_the_device_cannot_replay_is_reported_not_compared():
    module = experiment("gpu_replay")
    state = _state({"0/flexsp": 2.0, "0/batchada": 4.0})
    state["replays"]["1/flexsp"] = {"step": {"replayed_time": 2.0, "measured_share": 0.9}, "groups": [{"compute_error": 0.0}]}
    state["replays"]["1/batchada"] = {"error": "OutOfMemoryError: CUDA out of memory"}
    assert module.complete_steps(state) == [0, 1]
    rows = {r["strategy"]: r for r in module.rows(state)}
    assert rows["batchada"]["error"] == "not replayed: OutOfMemoryError: CUDA out of memory"
    assert rows["flexsp"]["replayed"] == 4.0 and "speedup_replayed" not in rows.get("batchada", {})
