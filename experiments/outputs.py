"""Where a script writes: ``experiments/results/`` for a full run, a scratch folder for ``--quick``.

A quick run (CI, a first try) must never overwrite the tracked results of a full run, so without an
explicit ``--out`` it writes under ``$FLEXSP_QUICK_OUT`` (set by the tests, to find the files) or one
scratch folder per user, ``<tmp>/flexsp-quick-<user>/``, that every quick run reuses (so quick runs
leave one folder behind, not one each), and says where when it ends.
"""
from __future__ import annotations

import atexit
import getpass
import os
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def quick_folder() -> Path:
    """``$FLEXSP_QUICK_OUT``, else ``<tmp>/flexsp-quick-<user>``: where quick runs write by default."""
    given = os.environ.get("FLEXSP_QUICK_OUT")
    if given:
        return Path(given)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):          # no user name (some containers): the uid
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"flexsp-quick-{user}"


def resolve_out(given: Path | None, quick: bool, default: Path) -> Path:
    """``given`` if set; else ``default`` for a full run; else the same name in the quick folder, which
    the run names on stderr when it ends."""
    if given is not None:
        return given
    if not quick:
        return default
    base = quick_folder()
    base.mkdir(parents=True, exist_ok=True)
    out = base if default == RESULTS else base / default.name
    atexit.register(lambda: print(f"{Path(sys.argv[0]).name} --quick: outputs in {out} (reused by every quick run; "
                                  f"--out DIR keeps them elsewhere)", file=sys.stderr))
    return out
