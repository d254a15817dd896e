"""Every benchmark script runs in its reduced (--quick) mode and prints the figures it reports."""
import pytest

from scripts import run_script

# script -> text its Markdown must contain
EXPECTED = {
    "planner_benchmark": ["FlexSP solve time (wall): median", "plan / lower bound: mean", "plan / coupled bound: mean",
                          "speedup over static SP 64", "**simulated**", "<!-- generated: readme -->",
                          "Small batches: solve pace", "| HF Trainer default (4 x 256, 4,096 tokens/rank) | 4 | 8 |",
                          "plan time / batchada's"],
    "scale_benchmark": ["| wikipedia | 64 |", "| long-mix | 256 |", "| gpt-7b-constants | 256 |", "plan / coupled bound", "plan / refined bound",
                        "Past the time limit", "communicators per rank", "**simulated**",
                        "<!-- generated: readme -->"],
    "dynamic_cp_benchmark": ["FlexSP speedup over dynamic-cp"],
    "robustness_benchmark": ["Planning time against the time limit", "| 10,000 | dynamic-cp |",
                             "Parser peak memory per MiB of input", "| lengths .npy |", "**Measured**"],
}


# the report each script writes; without --out a quick run puts it in $FLEXSP_QUICK_OUT
REPORT = {"dynamic_cp_benchmark": "dynamic_cp.md", "robustness_benchmark": "robustness.md",
          "planner_benchmark": "planner_benchmark.md", "scale_benchmark": "scale_benchmark.md"}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_quick_mode(script, tmp_path, tree_unchanged):
    run_script(script, "--quick", env={"FLEXSP_QUICK_OUT": str(tmp_path)})
    text = (tmp_path / REPORT[script]).read_text()
    for needle in EXPECTED[script]:
        assert needle in text, f"{script}: {needle!r} missing from its report"


def test_loader_benchmark_quick_mode(tmp_path):
    pytest.importorskip("torch")
    run_script("loader_benchmark", "--quick", "--out", tmp_path / "loader.md")
    text = (tmp_path / "loader.md").read_text()
    assert "loop throughput with background planning in a process" in text and "in a thread" in text


def _script(name):
    from scripts import experiment
    return experiment(name)


def test_planner_readme_block_marks_missed_targets():
    bench = _script("planner_benchmark")
    good = {"median_solve": 0.15, "max_solve": 2.0, "median_cpu": 0.1, "mean_ratio": 1.05, "max_ratio": 1.1,
            "mean_coupled": 1.04, "max_coupled": 1.1, "speedup_static64": 1.8, "speedup_batchada": 1.2}
    text = bench.readme_block(good, 1.0)
    assert "missed" not in text and text.count(": met") == 4
    bad = dict(good, median_solve=0.363, mean_ratio=1.0862, mean_coupled=1.0737, speedup_static64=1.5)
    text = bench.readme_block(bad, 1.0)
    assert "**median missed**" in text and "**missed by 0.6%**" in text and ">= 1.6x: **missed**" in text
    assert "<= 1.05: **missed by 2.3%**" in text


def test_history_rows_append(tmp_path):
    bench = _script("planner_benchmark")
    path = tmp_path / "history.md"
    bench.append_history("64 GPUs", "planner_benchmark", 0.16, 0.12, 1.0, 1.77, path)
    bench.append_history("16,384 GPUs", "scale_benchmark", 1.4, 1.1, 2.0, 0.5, path)
    lines = path.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| 20")]
    assert [r.split(" | ")[3:8] for r in rows] == [["64 GPUs", "0.160", "0.120", "1.0", "1.77 |"],
                                                   ["16,384 GPUs", "1.400", "1.100", "2.0", "0.50 |"]]
    header = next(line for line in lines if line.startswith("| date"))
    assert header.count("|") == rows[0].count("|") and "reference loop" in header


def test_reference_loop_and_machine_line():
    bench = _script("planner_benchmark")
    seconds = bench.reference_loop(repeats=1)
    assert 0.01 < seconds < 60
    line = bench.machine_line(0.0, 1.5, seconds)
    assert f"{seconds:.2f} s" in line and "load average 1.5" in line


def test_scale_readme_block_keeps_the_target_sizes():
    bench = _script("scale_benchmark")
    rows = [f"| wikipedia | {n:,} |" for n in (64, 1024, 16384)]
    text = bench.readme_block(["| h |", "|---|"], rows, [64, 1024, 16384], 2.0)
    assert "| wikipedia | 64 |" not in text and "| wikipedia | 1,024 |" in text and "**simulated**" in text
    assert "| wikipedia | 64 |" in bench.readme_block(["| h |"], rows[:1], [64], 2.0)   # --quick: nothing >= 1,024
    assert "reference loop (`planner_benchmark.reference_loop`) took 0.52 s" in bench.readme_block(
        ["| h |"], rows, [64, 1024, 16384], 2.0, 0.52)
