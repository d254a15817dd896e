"""The soak experiment's quick mode: 30 steps on 4 gloo ranks, flat RSS and communicators, clean exit."""
import json

import pytest

from scripts import run_script

pytest.importorskip("torch")


def test_soak_quick_mode_passes_its_leak_checks(tmp_path):
    run_script("soak", "--quick", "--out", tmp_path, timeout=150)
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["steps"] == 30 and summary["passed"], summary["pass"]
    for rank in summary["ranks"]:
        assert rank["threads_at_exit"] == [] and len(rank["communicators"]) == 1
        assert rank["rss_growth_mib"] <= summary["rss_bound_mib"]
    assert "quick mode" in (tmp_path / "soak.md").read_text()
