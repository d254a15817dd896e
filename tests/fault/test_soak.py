"""The soak experiment's quick mode: 30 steps on 4 gloo ranks, flat RSS and communicators, clean exit."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_soak_quick_mode_passes_its_leak_checks(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "soak.py"), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=150, cwd=ROOT,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["steps"] == 30 and summary["passed"], summary["pass"]
    for rank in summary["ranks"]:
        assert rank["threads_at_exit"] == [] and len(rank["communicators"]) == 1
        assert rank["rss_growth_mib"] <= summary["rss_bound_mib"]
    assert "quick mode" in (tmp_path / "soak.md").read_text()
