"""``flexsp replay``'s plan and output checks and ``simulate --strategies``'s entry checks: a bad input is one
error line and exit 2, found before any work (no replay, no simulation). torch-free: the replay is
stubbed to fail, so a check that comes too late fails the test instead of running a model."""
import json
import re

import pytest

import flexsp
import flexsp.evaluation.simulate
import flexsp.replay.cli
from flexsp.cli import main
from flexsp.errors import PlanError
from flexsp.plan.types import Plan

PLAN = {"num_gpus": 1, "predicted_time": 1.0, "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [0]}]}]}


@pytest.fixture()
def files(tmp_path, monkeypatch):
    """A one-group plan, its lengths and a cost model; replaying (``build``) and presets fail the test."""
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "lengths.txt").write_text("100\n")
    flexsp.CostModel(alpha1=2e-7, alpha2=1e-5, beta1=0.01, comm_bytes_per_token=768.0, token_capacity=256,
                     alltoall_bandwidth={2: 2e8}).save(tmp_path / "cost.json")
    monkeypatch.setattr(flexsp.replay.cli, "build", lambda *a, **k: pytest.fail("replayed before the error"))
    monkeypatch.setattr(flexsp.replay.cli, "cost_from_preset", lambda *a, **k: pytest.fail("preset built first"))
    return tmp_path


def replay(capsys, tmp, *extra: str, plan: str = "plan.json", cost: tuple[str, ...] = ()) -> tuple[int, str]:
    """``flexsp replay`` (``--cost`` the fixture's unless ``cost`` says otherwise): its status and one error line."""
    code = main(["replay", str(tmp / plan), "--lengths", str(tmp / "lengths.txt"),
                 *(cost or ("--cost", str(tmp / "cost.json"))), "--device", "cpu", "--quiet", *extra])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return code, errors[0]


# --- plan files: GPU counts and micro-batches within the caps ------------------------------------
@pytest.mark.parametrize("key", ["num_gpus", "gpus_per_node"])
def test_a_plans_gpu_counts_are_capped_like_gpus(monkeypatch, key):
    monkeypatch.delenv("FLEXSP_MAX_GPUS", raising=False)
    data = dict(PLAN, **{key: 2**62})
    with pytest.raises(PlanError, match=rf"^{key} 4611686018427387904 is over the cap of 1048576 GPUs; "
                                        r"raise it with --max-input gpus=N or \$FLEXSP_MAX_GPUS$"):
        Plan.from_dict(data)
    monkeypatch.setenv("FLEXSP_MAX_GPUS", str(2**62))
    assert getattr(Plan.from_dict(data), key) == 2**62


def test_replay_refuses_a_plan_for_too_many_gpus_before_building_a_cost_model(files, capsys, monkeypatch):
    """Before: ``num_gpus`` 2**62 reached the preset's tile tables (MemoryError traceback; 2**30: 3.8 GB)."""
    monkeypatch.delenv("FLEXSP_MAX_GPUS", raising=False)
    (files / "huge.json").write_text(json.dumps(dict(PLAN, num_gpus=2**62)))
    code, error = replay(capsys, files, plan="huge.json", cost=("--preset", "gpt-7b"))
    assert code == 2 and "num_gpus 4611686018427387904 is over the cap of 1048576 GPUs" in error, error


def test_many_empty_micro_batches_are_refused_against_the_groups_cap(monkeypatch):
    """Before: 4.8M ``{"groups": []}`` were all built (1.8 GB) before validation found micro-batch 0 empty."""
    monkeypatch.setenv("FLEXSP_MAX_GROUPS", "10")
    with pytest.raises(PlanError, match=r"the plan has 11 micro-batches, which need at least 11 groups, over the "
                                        r"cap of 10; raise it with --max-input groups=N"):
        Plan.from_dict(dict(PLAN, micro_batches=[{"groups": []}] * 11))
    assert len(Plan.from_dict(dict(PLAN, micro_batches=[{"groups": []}] * 10)).micro_batches) == 10


# --- replay's outputs, checked before the replay --------------------------------------------------
@pytest.mark.parametrize("flag, name, message", [
    ("--json", "missing/r.json", r"cannot write --json .*missing/r.json: folder .*missing does not exist"),
    ("--markdown", "missing/r.md", r"cannot write --markdown .*missing/r.md: folder .*missing does not exist"),
    ("--gantt", "missing/r.png", r"cannot write --gantt .*missing/r.png: folder .*missing does not exist"),
    ("--gantt", "r.txt", r"--gantt .*r.txt: a picture needs one of the suffixes .png, .pdf, .svg, e.g. r.png$"),
    ("--gantt", "r.jpg", r"--gantt .*r.jpg: a picture needs one of the suffixes .png, .pdf, .svg, e.g. r.png$"),
    ("--gantt", "gantt", r"--gantt .*gantt: a picture needs one of the suffixes .*, e.g. gantt.png$"),
    ("--json", ".", r"--json .* is a folder; give a file name"),
])
def test_replay_checks_its_outputs_first(files, capsys, flag, name, message):
    code, error = replay(capsys, files, flag, str(files / name))
    assert code == 2 and error.startswith("flexsp replay: error: ") and re.search(message, error), error


# --- simulate --strategies: each entry as plan --strategy checks it ------------------------------
@pytest.mark.parametrize("entry, message", [
    ("static:-8", "sp_degree must be >= 1, got -8 (in 'static:-8'"),
    ("static:0", "sp_degree must be >= 1, got 0 (in 'static:0'"),
    ("flexsp[0]", "each of degrees must be >= 1, got 0 (in 'flexsp[0]'"),
    ("flexsp,static:128", "degrees not usable on 64 GPUs in nodes of 8: 128 GPUs"),
    ("flexsp[1,8,96]", "degrees not usable on 64 GPUs in nodes of 8: 96 GPUs"),
    ("static:x", "static degree in 'static:x' must be an integer"),
    ("flexsp:3", "'flexsp:3': strategy 'flexsp' takes no SP degree"),
])
def test_simulate_refuses_a_bad_strategy_entry_before_simulating(capsys, monkeypatch, entry, message):
    """Before: ``static:-8`` was a table row ("-8 GPUs x 6,407 tokens = -51,256") and the run exited 0."""
    monkeypatch.setattr(flexsp.evaluation.simulate, "simulate", lambda *a, **k: pytest.fail("simulated first"))
    code = main(["simulate", "--quiet", "--strategies", entry])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("flexsp simulate: error: --strategies: "), err
    assert message in err, err


def test_simulate_keeps_good_strategy_entries():
    from argparse import Namespace

    from flexsp.cli import _strategies
    listed = "flexsp,static:8,flexsp[1,8,64],batchada[any],static:6"
    assert _strategies(Namespace(strategies=listed), flexsp.Cluster(64, 8)) == [
        "flexsp", "static:8", "flexsp[1,8,64]", "batchada[any]", "static:6"]
