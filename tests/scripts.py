"""Scripts of ``experiments/`` in tests: imported as a module (the folder is not a package) to test their
functions, or run as a user runs them (their ``--quick`` modes)."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def experiment(name: str):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))


def run_script(name: str, *args: str, timeout: float = 300, env: dict[str, str] | None = None):
    """Run ``experiments/NAME.py ARGS`` as a user would, from the checkout root with the checkout on
    ``PYTHONPATH`` (plus ``env``); assert it exits 0, showing the ends of its output if not."""
    root = EXPERIMENTS.parent
    paths = [str(root), os.environ.get("PYTHONPATH", "")]
    result = subprocess.run([sys.executable, str(EXPERIMENTS / f"{name}.py"), *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, cwd=root,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), **(env or {})})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result
