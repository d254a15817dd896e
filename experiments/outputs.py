"""Where a script writes: ``experiments/results/`` for a full run, a temporary folder for ``--quick``.

A quick run (CI, a first try) must never overwrite the tracked results of a full run, so without an
explicit ``--out`` it writes under ``$FLEXSP_QUICK_OUT`` (set by the tests, to find the files) or a
fresh temporary folder, and says where.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def resolve_out(given: Path | None, quick: bool, default: Path) -> Path:
    """``given`` if set; else ``default`` for a full run; else the same name in a temporary folder."""
    if given is not None:
        return given
    if not quick:
        return default
    base = Path(os.environ.get("FLEXSP_QUICK_OUT") or tempfile.mkdtemp(prefix="flexsp-quick-"))
    base.mkdir(parents=True, exist_ok=True)
    return base if default == RESULTS else base / default.name
