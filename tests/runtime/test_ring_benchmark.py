"""The ring benchmark runs in its --quick mode on 8 gloo ranks and reports the cost model's ring term."""
import pytest

from scripts import run_script

pytest.importorskip("torch")


def test_ring_benchmark_quick_mode(tmp_path):
    out = tmp_path / "ring.md"
    run_script("ring_benchmark", "--quick", "--out", out)
    text = out.read_text()
    assert "(8 gloo ranks)" in text and "a CPU figure" in text
    rows = [line for line in text.splitlines() if line.startswith("| 256 | 2 x 4 |")]
    assert len(rows) == 1
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        layer, compute, comm, term = (float(c) for c in cells[2:6])
        assert layer > 0 and compute > 0 and comm > 0 and term > 0
    assert "ring comm / ring term:" in text
