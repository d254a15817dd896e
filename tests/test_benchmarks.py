"""Every benchmark script runs in its reduced (--quick) mode and prints the figures it reports."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> text its Markdown must contain
EXPECTED = {
    "planner_benchmark": ["FlexSP solve time: median", "plan / lower bound: mean", "plan / coupled bound: mean",
                          "speedup over static SP 64"],
    "scale_benchmark": ["| wikipedia | 64 |", "| long-mix | 256 |", "| gpt-7b-constants | 256 |", "plan / coupled bound",
                        "Past the time limit", "communicators per rank"],
    "dynamic_cp_benchmark": ["FlexSP speedup over dynamic-cp"],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_benchmark_quick_mode(script, tmp_path):
    out = tmp_path / f"{script}.md"
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    for needle in EXPECTED[script]:
        assert needle in text, f"{script}: {needle!r} missing from its report"


def test_loader_benchmark_quick_mode(tmp_path):
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "loader_benchmark.py"), "--quick",
                             "--out", str(tmp_path / "loader.md")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "loader.md").read_text()
    assert "loop throughput with background planning in a process" in text and "in a thread" in text
