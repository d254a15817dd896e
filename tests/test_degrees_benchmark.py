"""experiments/degrees_benchmark.py: its --quick mode runs, writes only to the quick folder, and its
verdict follows the figures."""
import numpy as np

from scripts import experiment, run_script


def test_quick_mode_prints_every_figure(tmp_path, tree_unchanged):
    run_script("degrees_benchmark", "--quick", env={"FLEXSP_QUICK_OUT": str(tmp_path)})
    text = (tmp_path / "degrees_benchmark.md").read_text()
    for needle in ("**simulated**", "**measured**", "Load average", "| pow2 |", "| any |", "| chain |", "pow2 / set, comms paid",
                   "comms / rank", "comm memory (GiB)", "VERDICT:"):
        assert needle in text, needle


def _rows(any_paid: float, any_solve: float):
    bench = experiment("degrees_benchmark")
    s = bench.Setting("x", "gpt-7b", 64, 8, "wikipedia", 8)
    pow2 = {"free": np.array([2.0, 2.0]), "paid": np.array([2.0, 2.0]), "solve": 0.1, "comms": 6, "gib": 3.0, "why": ""}
    other = {"free": np.array([2.0, 2.0]) / any_paid, "paid": np.array([2.0, 2.0]) / any_paid, "solve": any_solve,
             "comms": 14, "gib": 7.0, "why": ""}
    return bench, [(s, {"pow2": pow2, "pow2+3x": other, "any": other, "chain": pow2})]


def test_verdict_needs_a_clear_win_within_the_solve_targets():
    bench, rows = _rows(1.10, 0.15)
    assert bench.verdict(rows)[1] and "becomes the default" in bench.verdict(rows)[0]
    bench, rows = _rows(1.01, 0.15)
    assert not bench.verdict(rows)[1] and "power-of-two stays the default" in bench.verdict(rows)[0]
    bench, rows = _rows(1.10, 0.5)             # 5x slower to solve, above the 0.2 s target at 64 GPUs
    assert not bench.verdict(rows)[1] and "solve time" in bench.verdict(rows)[0]


def test_verdict_when_any_degree_pools_cannot_plan():
    bench, rows = _rows(1.10, 0.15)
    rows[0][1]["any"] = dict(rows[0][1]["any"], paid=None, why="no memory left")
    line, wins = bench.verdict(rows)
    assert not wins and "cannot plan x at 64 GPUs (14 communicators per rank, 7 GiB: no memory left)" in line
