"""Test glue for the HF examples (examples/hf_trainer.py, examples/sft_trl.py): run one as a user runs it, on
one process or ``ranks`` gloo ranks under torchrun, and read back its logged losses and saved weights."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from safetensors.torch import load_file
from scripts import experiment

# 4 optimizer steps, a checkpoint every 2: enough for a moving loss curve and a resume from step 2
STEPS = ("--steps", "4", "--save-steps", "2", "--sequences", "32")


def run_example(example: Path, tmp_path: Path, name: str, *argv: str, ranks: int = 1,
                timeout: float = 300) -> dict[int, float]:
    """Run ``example`` with ``STEPS`` and ``argv``, writing to ``tmp_path/name``; assert it exits 0 within
    ``timeout`` seconds (showing the end of its output if not) and return its loss per optimizer step."""
    launcher, env = experiment("launch").torchrun(ranks)
    history = tmp_path / f"{name}.json"
    proc = subprocess.run([*launcher, str(example), *STEPS, "--out", str(tmp_path / name), "--history", str(history),
                           *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {int(k): v for k, v in json.loads(history.read_text())["losses"].items()}


def saved_params(tmp_path: Path, name: str, step: int) -> dict:
    """The model weights run ``name`` saved at optimizer step ``step``."""
    return load_file(str(tmp_path / name / f"checkpoint-{step}" / "model.safetensors"))
