"""examples/train.py as a user runs it (issue 38, points 4 and 9): any world size, not only powers of two
(its data is sized for the largest SP group the world runs), and a bad ``--steps`` refused in one line."""
import subprocess
from pathlib import Path

import pytest
from scripts import experiment

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"


def _run(ranks: int, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    launcher, env = experiment("launch").torchrun(ranks)
    return subprocess.run([*launcher, str(EXAMPLE), *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_runs_at_three_ranks():
    # 3 ranks: the largest SP group is 2 ranks (512 tokens), so the default 600-token cap cannot hold
    proc = _run(3, "--steps", "2", "--dataset-size", "64", "--batch-size", "12", "--strategy", "greedy")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "world 3 (gloo)" in proc.stdout and "step   1" in proc.stdout
    longest = max(int(line.split("(max ")[1].split(")")[0]) for line in proc.stdout.splitlines() if "(max " in line)
    assert longest <= 512


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_bad_steps_is_one_line_and_exit_2(value):
    proc = _run(1, "--steps", value, timeout=120)
    assert proc.returncode == 2
    why = "expected an integer, got 'two'" if value == "two" else f"must be >= 1, got {value}"
    assert proc.stderr.strip().splitlines() == [f"train.py: error: argument --steps: {why} (usage: train.py --help)"]
    assert proc.stdout == ""
