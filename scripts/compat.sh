#!/usr/bin/env bash
# Run the Hugging Face tests against one transformers release (default: the OLDEST of the `hf` extra's range).
#
#   scripts/compat.sh                 # transformers 5.22.2 (oldest of the range), fresh .compat-venv, torch CPU
#   scripts/compat.sh 5.24.0          # any other release
#   BASE_SITE=/path/to/venv/lib/python3.11/site-packages scripts/compat.sh
#                                     # reuse torch & co. from an existing env (a .pth behind the new venv's own
#                                     # site-packages), installing only transformers/accelerate: no torch download
#
# CI (.ci/run) tests the newest pinned release; this script is how the oldest is checked. It runs the
# single-process HF tests plus the 4-rank family subset and the Trainer test.
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.22.2
VERSION="${1:-$OLDEST}"
VENV=".compat-venv-${VERSION}"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -n "${BASE_SITE:-}" ]; then
    echo "$BASE_SITE" > "$SITE/zz_base_site.pth"      # after the venv's own packages: its transformers wins
    python -m pip install --quiet --no-deps "transformers==${VERSION}"
else
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet "torch==2.13.0" "transformers==${VERSION}"
    python -m pip install --quiet -e ".[train,dev,hf]"
fi
python -c "import transformers; assert transformers.__version__ == '${VERSION}', transformers.__version__; print('transformers', transformers.__version__)"
PYTHONPATH="$PWD" python -m pytest -q tests/hf/test_adapter.py tests/hf/test_families.py tests/hf/test_trainer.py
