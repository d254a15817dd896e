"""``flexsp profile --hf-config DIR`` times the user's transformers model (through the adapter), not TinyLM."""
import argparse
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flexsp import CostModel  # noqa: E402
from flexsp.hf import HFCausalLM  # noqa: E402
from flexsp.profile import cli  # noqa: E402
from flexsp.profile.compute import DeviceSetup, GroupRunner, hf_builder  # noqa: E402

from .models import config  # noqa: E402


def _run(argv):
    parser = argparse.ArgumentParser(prog="flexsp")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return cli.run(parser.parse_args(["profile", *argv]))


def test_profile_times_the_hf_model_from_its_config_dir(tmp_path):
    config("qwen3").save_pretrained(tmp_path / "model")
    out = tmp_path / "cost.json"
    rc = _run(["--hf-config", str(tmp_path / "model"), "--device", "cpu", "--clock", "cpu", "--statistic", "min",
               "--lengths", "128,256,384,512", "--memory-lengths", "128,256", "--memory-gb", "1", "--repeats", "2",
               "--warmup", "0", "--quiet", "--force", "-o", str(out), "--report", str(tmp_path / "report.json")])
    assert rc == 0   # --force: this test checks the shape read from the config, not the fit's noise (CI saw 11%)
    cost = CostModel.load(out)
    shape = cost.meta["model"]
    assert (shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"], shape["vocab"]) == \
        (2, 32, 4, 2, 48, 128)
    assert shape["name"].startswith("hf:qwen3:")
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["compute"]["points"]) == 4 and cost.alpha1 + cost.alpha2 > 0   # grows with length


def test_runner_runs_the_adapter_with_run_layers():
    spec, build = hf_builder(config("gemma"), max_seqlen=512)
    runner = GroupRunner(spec, DeviceSetup.resolve("cpu", "fp32"), run_layers=1, build=build)
    assert isinstance(runner.model, HFCausalLM) and isinstance(runner.base, HFCausalLM)
    assert runner.model.model.config.num_hidden_layers == 1 and runner.base.model.config.num_hidden_layers == 0
    assert len(runner.time_group([20, 12], repeats=1, warmup=0)) == 1


def test_hf_config_and_shape_flags_conflict(capsys):
    assert _run(["--hf-config", "llama", "--hidden", "64", "--device", "cpu", "--quiet"]) == 2
    assert "--hf-config takes the shape from the model's config" in capsys.readouterr().err
    assert _run(["--hf-config", "nope", "--device", "cpu", "--quiet"]) == 2
    assert "neither a directory with config.json" in capsys.readouterr().err
