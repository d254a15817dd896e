import sys
from pathlib import Path

# tests/validator.py is shared by test modules in several folders
sys.path.insert(0, str(Path(__file__).parent))


import subprocess

import pytest

ROOT = Path(__file__).resolve().parents[1]


def git_status() -> str | None:
    """``git status --porcelain`` of the checkout (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@pytest.fixture(scope="module")
def tree_unchanged():
    """Fails the module's tests if running them changed a tracked file (or left an untracked one):
    README commands, examples and --quick runs must write outside the repository's files."""
    before = git_status()
    yield
    if before is not None:
        assert git_status() == before, "running these left the tree changed; outputs belong in a temp or run folder"
