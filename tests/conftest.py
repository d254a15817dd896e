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
