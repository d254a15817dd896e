import sys
from pathlib import Path

# tests/validator.py is shared by test modules in several folders
sys.path.insert(0, str(Path(__file__).parent))

import os  # noqa: E402
import tempfile  # noqa: E402

# Checkpoint tests sign with a per-user key created on first save; keep it out of the real home (and
# shared by every rank a test launches, as one job's key would be).
if not os.environ.get("FLEXSP_CHECKPOINT_KEY") and not os.environ.get("FLEXSP_CHECKPOINT_KEY_FILE"):
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="flexsp-test-config-")

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


@pytest.fixture(autouse=True)
def one_thread(request):
    """Torch tests run tiny models: one thread is fastest, and two spin badly on a shared 2-core machine
    while gloo ranks run beside the test's single-process reference (13-18 s vs 0.05 s measured)."""
    torch = sys.modules.get("torch")           # torch-free tests stay torch-free
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
