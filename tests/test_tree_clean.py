"""The README's commands and the example leave the repository as they found it (outputs go to temporary
or run folders); the --quick benchmark runs check the same in tests/test_experiments.py and
tests/test_benchmarks.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_default_simulation_writes_nothing(tree_unchanged):
    result = subprocess.run([sys.executable, "-m", "flexsp", "simulate", "--quiet", "--steps", "2"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| flexsp |" in result.stdout


def test_training_example_writes_nothing(tree_unchanged, tmp_path):
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, "examples/train.py", "--steps", "2", "--dataset-size", "64"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step   1" in result.stdout
