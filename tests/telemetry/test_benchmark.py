"""The closed-loop benchmark runs in its quick mode, writes only where --out says, and labels every figure."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_closed_loop_benchmark_quick(tmp_path):
    out = tmp_path / "closed_loop.md"
    before = sorted(p.name for p in (ROOT / "experiments" / "results").iterdir())
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "closed_loop_benchmark.py"), "--quick",
                             "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (ROOT / "experiments" / "results").iterdir()) == before
    text = out.read_text()
    for needle in ("**simulated: group times from the paper's gpt-7b", "**measured on CPU", "not a GPU figure",
                   "## 1. Refit", "## 2. Refit", "## 3. Measurement overhead", "recorder hooks", "recording on"):
        assert needle in text
    assert "[SIM] error below 5%" in result.stdout and "[CPU] overhead" in result.stdout
    sim_rows = [line for line in text.split("## 2.")[0].splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(sim_rows) == 6
