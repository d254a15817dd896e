"""What a new user meets (issue 38): a sequence bigger than the cluster, degree sets without a power of two,
bad arguments and strategies, and errors about a lengths file, each as one line in the user's own terms."""
from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import flexsp
from flexsp.cli import main
from flexsp.errors import PlanError
from flexsp.plan.config import PlanConfig
from flexsp.plan.presets import cost_from_preset
from tests.validator import check_plan

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flexsp {command}: error: "), err
    return lines[0]


# --- 1: a sequence bigger than the cluster -----------------------------------------------------------------
def test_simulate_names_the_line_that_the_cluster_cannot_hold(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("100\n300000\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no NaN RuntimeWarning on the way
        status = main(["simulate", "--dataset", str(big), "--gpus", "16", "--steps", "2", "--batch-size", "4",
                       "--quiet"])
    assert status == 2
    line = _one_error_line(capsys.readouterr().err, "simulate")
    held = cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=16).group_capacity(16)
    assert f"{big} line 2: a sequence of 300,000 tokens" in line
    assert f"16 GPUs x " in line and f"= {held:,}" in line and f"--context {held - held % 32}" in line


def test_no_gantt_of_a_run_the_cluster_cannot_hold(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("100\n\n300000\n")
    gantt = tmp_path / "g.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = main(["simulate", "--dataset", str(big), "--gpus", "24", "--steps", "2", "--batch-size", "4",
                       "--quiet", "--gantt", str(gantt)])
    assert status == 2 and not gantt.exists()
    line = _one_error_line(capsys.readouterr().err, "simulate")
    assert f"{big} line 3:" in line and "largest SP degree allowed (the cluster's largest is 24" in line


def test_a_padded_length_is_named_by_its_value_in_the_file(tmp_path, capsys):
    """'sequence 109 has 156384 tokens' for a file whose maximum is 156383: now its line, value and padding."""
    held = cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=16).group_capacity(16)
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["500"] * 8 + ["", str(held + 1)]) + "\n")
    assert main(["simulate", "--dataset", str(lengths), "--gpus", "16", "--steps", "3", "--batch-size", "32",
                 "--quiet"]) == 2
    line = _one_error_line(capsys.readouterr().err, "simulate")
    padded = -(-(held + 1) // 32) * 32
    assert f"{lengths} line 10: a sequence of {held + 1:,} tokens ({padded:,} once padded to a multiple of 2 x 16" \
        in line


def test_a_restricted_strategy_that_cannot_hold_a_draw_is_infeasible_in_the_files_terms(tmp_path):
    from flexsp.evaluation.simulate import simulate
    from flexsp.plan.lengths import get_distribution
    lengths = tmp_path / "m.txt"
    lengths.write_text("100\n200\n\n60000\n")
    cluster, cost = flexsp.Cluster(64, 8), cost_from_preset("gpt-7b", num_gpus=64)
    sim = simulate(get_distribution(str(lengths)), cost, cluster, ["batchada", "static:8", "flexsp[1,2]"], steps=2,
                   batch_size=8, progress=False)
    assert not sim.runs["batchada"].error
    for name, degree in (("static:8", 8), ("flexsp[1,2]", 2)):
        assert sim.runs[name].error.startswith(f"{lengths} line 4: a sequence of 60,000 tokens (60,032 once padded")
        assert f"is more than {name} holds: {degree} GPUs x" in sim.runs[name].error


def test_bounds_refuse_a_batch_no_plan_can_hold_without_nan():
    from flexsp.plan.bounds import coupled_lower_bound, lower_bound
    cluster, cost = flexsp.Cluster(16, 8), cost_from_preset("gpt-7b", num_gpus=16)
    lengths = [1000, 300_000, 400_000]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for bound in (lower_bound, coupled_lower_bound):
            with pytest.raises(PlanError, match="sequence 2 has 400000 tokens, more than the whole cluster can hold"):
                bound(lengths, cost, cluster)


# --- 2: degree sets without a power of two ------------------------------------------------------------------
@pytest.mark.parametrize("degrees", [(3,), (6,), (3, 6)])
@pytest.mark.parametrize("strategy", ["flexsp", "greedy", "batchada", "dynamic-cp", "static"])
def test_plans_with_exactly_the_degrees_given(degrees, strategy):
    cluster, cost = flexsp.Cluster(64, 8), cost_from_preset("gpt-7b", num_gpus=64)
    rng = np.random.default_rng(0)
    lengths = (rng.pareto(1.2, 48) * 2000 + 300).astype(np.int64).clip(1, cost.group_capacity(max(degrees)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                # a TimeLimitWarning on a loaded machine is fine here
        plan = flexsp.plan_batch(lengths, cost, cluster, strategy, degrees=degrees, time_limit=30)
    assert check_plan(plan.to_dict(), lengths, cost, 64, 8) == pytest.approx(plan.predicted_time, rel=1e-9)
    assert set(plan.degree_histogram()) <= set(degrees)


def test_cli_plans_with_degree_three_and_six(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 9000, 1200, 15000, 50, 700] * 4) + "\n")
    for degrees in ("3", "6", "3,6"):
        out = tmp_path / f"p{degrees}.json"
        assert main(["plan", str(lengths), "--degrees", degrees, "-o", str(out)]) == 0, capsys.readouterr().err
        plan = flexsp.Plan.from_json(out.read_text())
        assert set(plan.degree_histogram()) <= {int(d) for d in degrees.split(",")}


# --- 6, 7, 8: arguments and strategies ---------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["simulate", "--gpus", "-4"], "argument --gpus: must be >= 1, got -4"),
    (["simulate", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["plan"], "the following arguments are required: lengths"),
    (["simulate", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in _one_error_line(capsys.readouterr().err, argv[0])


def test_plan_config_refuses_an_unknown_strategy_when_built():
    with pytest.raises(PlanError, match=r"unknown strategy 'fast'; choose one of flexsp, "):
        PlanConfig(strategy="fast")
    with pytest.raises(PlanError, match="unknown strategy None"):
        PlanConfig(strategy=None)
    with pytest.raises(PlanError, match="takes no SP degree"):
        PlanConfig(strategy="flexsp:8")
    with pytest.raises(PlanError, match="sets sp_degree=8 but sp_degree=4 is given too"):
        PlanConfig(strategy="static:8", sp_degree=4)


def test_one_strategy_syntax_for_config_plan_and_simulate(tmp_path, capsys):
    config = PlanConfig(strategy="static:8")
    assert (config.strategy, config.sp_degree) == ("static", 8)
    assert PlanConfig(strategy="flexsp[1,8]").degrees == (1, 8)
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(n) for n in [300, 9000, 1200, 15000] * 4) + "\n")
    assert main(["plan", str(lengths), "--strategy", "static:8", "-o", str(tmp_path / "p.json")]) == 0
    assert set(flexsp.Plan.from_json((tmp_path / "p.json").read_text()).degree_histogram()) == {8}
    assert main(["plan", str(lengths), "--strategy", "fast", "-o", str(tmp_path / "q.json")]) == 2
    assert "unknown strategy 'fast'" in _one_error_line(capsys.readouterr().err, "plan")


# --- 10: lengths files in their own terms -------------------------------------------------------------------
def test_plan_names_the_file_line(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n\n200\n30000\n")
    assert main(["plan", str(lengths), "--degrees", "3", "-o", str(tmp_path / "p.json")]) == 2
    assert f"{lengths} line 4: a sequence of 30,000 tokens, more than the whole cluster can hold: 3 GPUs" in \
        _one_error_line(capsys.readouterr().err, "plan")
    assert main(["plan", str(lengths), "--context", "1000", "-o", str(tmp_path / "p.json")]) == 2
    assert f"the first is {lengths} line 4 with 30,000" in _one_error_line(capsys.readouterr().err, "plan")


def test_locate_counts_blank_lines_and_npy_entries(tmp_path):
    from flexsp.plan.lengths import locate
    text = tmp_path / "l.txt"
    text.write_text("\n5\n\n  \n7\n9\n")
    assert [locate(text, i) for i in range(3)] == [f"{text} line {n}" for n in (2, 5, 6)]
    npy = tmp_path / "l.npy"
    np.save(npy, np.array([5, 7]))
    assert locate(npy, 1) == f"{npy} entry 1"


# --- 17: names a reader sees ---------------------------------------------------------------------------------
def test_plan_batch_signature_reads_well_and_docs_allow_any_tiled_size():
    shown = str(inspect.signature(flexsp.plan_batch))
    assert "object at 0x" not in shown and "strategy: 'str' = <the config's strategy>" in shown
    assert "power-of-two sizes" not in (ROOT / "docs" / "design.md").read_text()


def test_simulate_takes_both_progress_spellings(capsys):
    for flag in ("--quiet", "--no-progress"):
        assert main(["simulate", flag, "--steps", "1", "--batch-size", "16", "--gpus", "8",
                     "--strategies", "batchada", "--context", "32K"]) == 0
    assert "simulate" not in capsys.readouterr().err                       # no progress bar on stderr
