"""A runtime command in a planner-only install names the extra to install (issue 31, point 6): before,
``flexsp replay`` and ``flexsp profile`` ended in a raw ``ModuleNotFoundError: torch``."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Blocked())
from flexsp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*argv):
    return subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_profile_without_torch_names_the_train_extra():
    out = _run("profile", "--quiet")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "flexsp profile: error: this command needs torch" in out.stderr and "flexsp[train]" in out.stderr


def test_replay_without_torch_names_the_train_extra(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"num_gpus": 64, "predicted_time": 1.0,
                                "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [0]}]}]}))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("8\n")
    out = _run("replay", str(plan), "--lengths", str(lengths), "--preset", "gpt-7b")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "flexsp[train]" in out.stderr, out.stderr


def test_the_planner_commands_still_work_without_torch(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["100", "2000", "300"]) + "\n")
    out = _run("plan", str(lengths), "-o", str(tmp_path / "plan.json"), "--time-limit", "0.5")
    assert out.returncode == 0, out.stderr
