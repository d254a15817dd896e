"""examples/train_hf.py end to end in a world of one: local jsonl through datasets, byte tokens, Checkpointer
checkpoints, and --resume continuing from the last one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def test_train_hf_example_runs_and_checkpoints(tmp_path):
    data = tmp_path / "corpus.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"body": f"paragraph {i}: " + "flexsp plans sequence parallel groups. " * (1 + i % 7)}) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_hf.py"), "--model", "qwen2", "--data", str(data),
                           "--text-field", "body", "--steps", "3", "--batch-size", "6", "--max-len", "200",
                           "--checkpoint-every", "2", "--log-every", "1", "--out", str(tmp_path / "ck")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "data: 40 sequences from corpus.jsonl" in out and "Qwen2ForCausalLM" in out
    assert "done: 3 steps" in out and "tok/s" in out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(l > 0 for l in losses)
    ck = tmp_path / "ck" / "checkpoints" / "step-000000002"
    saved = json.loads((ck / "flexsp.json").read_text())
    assert saved["loader"]["index"] == 2 and any(ck.glob("*.distcp"))
    # --resume continues from step 2 and runs to 4: two more steps, the first of them step 3
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_hf.py"), "--model", "qwen2", "--data", str(data),
                           "--text-field", "body", "--steps", "4", "--batch-size", "6", "--max-len", "200",
                           "--checkpoint-every", "2", "--log-every", "1", "--out", str(tmp_path / "ck"), "--resume"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "resume: from step 2" in out and "done: 4 steps" in out
    assert [int(line.split()[1]) for line in out.splitlines() if line.startswith("step ")] == [3, 4]
    assert (tmp_path / "ck" / "checkpoints" / "step-000000004" / "flexsp.json").exists()
