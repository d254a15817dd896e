"""What importing FlexSP costs a process: every rank, planner process and CLI call starts by importing it, so
modules that take a second to import are read where they are used. ``torch.nn.attention.varlen`` imports
``torch._dynamo`` (1.3-1.9 s on this machine; a CPU run never calls varlen), ``scipy.optimize`` takes 0.4 s and
only fits use it; ``numba`` (0.2-0.3 s) loads with the first plan (``solver/kernels.py``)."""
import subprocess
import sys

import pytest

HEAVY = ("torch.nn.attention.varlen", "torch._dynamo", "scipy.optimize", "numba")


def _imports(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_cli_and_the_planner_import_no_heavy_module():
    proc = _imports(f"import sys, flexsp, flexsp.cli, flexsp.telemetry, flexsp.profile\n"
                    f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_the_runtime_reads_torchs_varlen_on_first_use():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = _imports(f"import sys, flexsp.runtime, flexsp.data, flexsp.hf, flexsp.cli\n"
                    f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
                    "from flexsp.runtime import kernels\n"
                    "from flexsp.runtime.kernels import varlen\n"
                    "assert kernels.VARLEN is varlen.VARLEN is varlen.api()\n"
                    "print('torch.nn.attention.varlen' in sys.modules)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[]", "True"]
