"""The degree-1 step benchmark runs in its quick mode, writes only where it is told, labels its figures
as measured on CPU and finds the contenders' losses equal (same weights, same batch), the HF adapter's
rows included."""
import pytest

from scripts import run_script

pytest.importorskip("torch")


def test_step_benchmark_quick(tmp_path):
    out = tmp_path / "step.md"
    result = run_script("step_benchmark", "--quick", "--out", out, timeout=600)
    text = out.read_text()
    assert "Measured on CPU" in text and "load average" in text
    row = next(line for line in text.splitlines() if line.startswith("| 256 "))
    assert float(row.split("|")[-2]) < 1e-4                      # loss spread of the three contenders
    hf_row = next(line for line in text.split("The HF adapter against HF native")[1].splitlines() if line.startswith("| 256 "))
    assert float(hf_row.split("|")[-2]) < 1e-4                   # flexsp hf / hf packed / hf each
    assert "flexsp hf vs the faster native path" in text
    assert ("MISSED" in text) == ("MISSED" in result.stdout)      # a miss is printed where it is written
