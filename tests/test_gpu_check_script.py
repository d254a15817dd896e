"""scripts/gpu_check.sh is what a short GPU loan runs in one call: it must at least parse, and name the
checks docs/training.md says it runs (its CPU rehearsal, FLEXSP_GPU_CHECK_CPU=1, repeats tests CI runs anyway)."""
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_gpu_check_script_parses_and_runs_the_documented_checks():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    text = SCRIPT.read_text()
    for check in ('-k "cuda or varlen"', "selftest --device cuda", "gpu_step_benchmark.py --budget-s"):
        assert check in text
