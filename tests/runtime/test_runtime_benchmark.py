"""The runtime benchmark runs in its quick mode on 4 gloo ranks and writes its labelled CPU table."""
import pytest

from scripts import run_script

pytest.importorskip("torch")


def test_runtime_benchmark_quick(tmp_path):
    out = tmp_path / "runtime.md"
    run_script("runtime_benchmark", "--quick", "--out", out, timeout=600)
    text = out.read_text()
    assert "measured on CPU" in text and "not a GPU figure" in text
    rows = [line for line in text.splitlines() if line.startswith("| flexsp") or line.startswith("| static")]
    assert len(rows) == 4
    # Sharded states are a quarter of the replicated ones on every rank (the model's dims divide by 4).
    states = {tuple(c.strip() for c in row.split("|")[1:3]): [float(x) for x in row.split("|")[6].split("/")]
              for row in rows}
    for plan in ("flexsp", "static (degree 4)"):
        for full, none in zip(states[(plan, "full")], states[(plan, "none")]):
            assert full == pytest.approx(none / 4, rel=0.05)
