"""The closed-loop benchmark runs in its quick mode, writes only where --out says, and labels every figure."""
from pathlib import Path

import pytest

from scripts import run_script

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_closed_loop_benchmark_quick(tmp_path):
    out = tmp_path / "closed_loop.md"
    before = sorted(p.name for p in (ROOT / "experiments" / "results").iterdir())
    result = run_script("closed_loop_benchmark", "--quick", "--out", out)
    assert sorted(p.name for p in (ROOT / "experiments" / "results").iterdir()) == before
    text = out.read_text()
    for needle in ("**simulated: group times from the paper's gpt-7b", "**measured on CPU", "not a GPU figure",
                   "## 1. Refit", "## 2. Refit", "## 3. Measurement overhead", "recorder hooks", "recording on"):
        assert needle in text
    assert "[SIM] error below 5%" in result.stdout and "[CPU] overhead" in result.stdout
    sim_rows = [line for line in text.split("## 2.")[0].splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(sim_rows) == 6
