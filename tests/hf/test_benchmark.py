"""experiments/hf_attention_benchmark.py --quick: FlexSP vs native attention, same loss."""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "hf_attention_benchmark.py"


def test_quick_mode(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("hf_attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["quick"] and result["loss_rel_diff"] < 1e-5 and result["tokens"] == 96 + 64 + 33 + 17
    assert set(result["rows"]) == {"native", "flexsp"} and "(quick mode)" in capsys.readouterr().out
