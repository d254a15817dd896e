"""scripts/gpu_check.sh is what a short GPU loan runs in one call: it must parse, name the checks
docs/training.md says it runs, say in one line what the box lacks, and its CPU rehearsal
(FLEXSP_GPU_CHECK_CPU=1: the same steps, quick modes, gloo on CPU tensors for the ranks step) must pass
here, leaving at most 8 files in its output folder."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_script_parses_and_runs_the_documented_checks():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    text = SCRIPT.read_text()
    for check in ("tests/runtime/test_cuda_real.py", "selftest --device cuda", "gpu_step_benchmark.py --budget-s 60",
                  "shared_gpu_ranks.py --device cuda", "scripts/gpu_facts.py"):
        assert check in text
    assert "-k \"cuda or varlen\"" not in text and "pytest -q tests " not in text   # no whole-tree collection


def _facts_module():
    spec = importlib.util.spec_from_file_location("gpu_facts", ROOT / "scripts" / "gpu_facts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_facts_say_in_one_line_what_is_missing_and_what_it_changes(monkeypatch, capsys, tmp_path):
    pytest.importorskip("torch")
    facts = _facts_module()
    real = facts.version
    monkeypatch.setattr(facts, "version", lambda name: None if name in ("pytest", "liger-kernel") else real(name))
    assert facts.main([str(tmp_path / "facts.json"), "--cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert "missing: pytest (tests step); liger-kernel (the LM-head loss falls back" in lines[0]
    saved = json.loads((tmp_path / "facts.json").read_text())
    assert saved["packages"]["pytest"] is None and "varlen_api" in saved and "device_facts" in saved
    assert facts.main([str(tmp_path / "f2.json")]) == (0 if __import__("torch").cuda.is_available() else 2)


@pytest.mark.skipif(os.environ.get("FLEXSP_SKIP_SLOW") == "1", reason="FLEXSP_SKIP_SLOW=1")
def test_the_cpu_rehearsal_passes_every_step(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    # the tests step narrowed to one file's signature checks: the suite runs every selected test itself; the
    # rehearsal is about the script (named files, no hypothesis, its summary)
    env = {**os.environ, "FLEXSP_GPU_CHECK_CPU": "1", "PYTHON": sys.executable, "FLEXSP_GPU_CHECK_SELECT": "signature"}
    run = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1500)
    summary = (out / "summary.txt").read_text()
    assert run.returncode == 0, summary + run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["facts.json", "gpu_step.json", "logs.tgz", "ranks.json", "selftest.json", "summary.txt"]
    for step in ("tests", "selftest", "gpu_step", "ranks"):
        assert f"{step}" in summary and "steps not passed: 0" in summary
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks["pass"] and ranks["degrees"] == [2, 2, 4] and "send/recv" in ranks["ring"]
    assert ranks["max_relative_error"] <= ranks["tolerance"]
