"""The replay recipe of docs/simulation.md runs as written (issue 38.14: with the bundled CPU profile it failed
with "no all-to-all bandwidth for SP degree 2"): every line, in a folder laid out like the checkout."""
import shlex
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from flexsp.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LEAD = "On a CPU, from the checkout (a test runs these lines as written)"


def recipe() -> list[str]:
    text = (ROOT / "docs" / "simulation.md").read_text()
    assert LEAD in text, "docs/simulation.md lost the replay recipe this test runs"
    block = text.split(LEAD, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_replay_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")       # `cp experiments/results/...` as in a checkout
    monkeypatch.chdir(tmp_path)
    lines = recipe()
    assert any(line.startswith("flexsp replay ") for line in lines)
    for line in lines:
        if line.startswith("flexsp "):          # the CLI in this process (torch is imported once)
            assert main(shlex.split(line, comments=True)[1:]) == 0, (line, capsys.readouterr())
        else:
            subprocess.run(["bash", "-c", line], check=True, cwd=tmp_path, timeout=60)
    out = capsys.readouterr().out
    assert "| **step** |" in out and "replayed total (s)" in out
    assert (tmp_path / "replay.json").stat().st_size > 0 and (tmp_path / "replay.png").stat().st_size > 1000
