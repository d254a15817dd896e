"""Import a script of ``experiments/`` as a module (the folder is not a package), for tests of its functions."""
import importlib
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def experiment(name: str):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))
