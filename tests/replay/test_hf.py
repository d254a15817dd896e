"""Hugging Face models replay through the same seam (runs once ``flexsp.hf`` is part of the build)."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
hf = pytest.importorskip("flexsp.hf", reason="flexsp.hf (Hugging Face adapter) is not in this build")

import flexsp  # noqa: E402
from flexsp.cli import main  # noqa: E402
from flexsp.profile.compute import DeviceSetup  # noqa: E402
from flexsp.replay import Replayer  # noqa: E402
from flexsp.replay.hf import hf_replay_model  # noqa: E402


def _cost():
    return flexsp.CostModel(alpha1=2e-7, alpha2=1e-5, beta1=0.01, comm_bytes_per_token=1024.0, token_capacity=512,
                            alltoall_bandwidth={2: 2e8, 4: 1.5e8})


def test_hf_config_directory_replays_with_layer_scaling(tmp_path):
    hf.tiny_config("llama", num_hidden_layers=3).save_pretrained(tmp_path)
    setup = DeviceSetup.resolve("cpu", "fp32", "sdpa")
    model = hf_replay_model(tmp_path, setup, run_layers=1)
    assert (model.heads, model.kv_heads, model.vocab) == (4, 2, 256)
    assert [w for _, w in model.parts] == [3.0, -2.0] and model.shape.layers == 3
    lengths = [40, 24, 8]
    cost = _cost()
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(4, 4), "static", sp_degree=4)
    report = Replayer(model, setup, repeats=1, warmup=0).replay(plan, lengths, cost)
    assert report.groups and all(g.compute != 0 for g in report.groups)


def test_hf_config_from_the_command_line(tmp_path, capsys):
    hf.tiny_config("llama").save_pretrained(tmp_path / "cfg")
    cost = _cost()
    cost.save(tmp_path / "cost.json")
    np.savetxt(tmp_path / "lengths.txt", [30, 20, 10], fmt="%d")
    flexsp.plan_batch([30, 20, 10], cost, flexsp.Cluster(2, 2), "flexsp", time_limit=0.2).save(tmp_path / "plan.json")
    rc = main(["replay", str(tmp_path / "plan.json"), "--lengths", str(tmp_path / "lengths.txt"), "--cost",
               str(tmp_path / "cost.json"), "--hf-config", str(tmp_path / "cfg"), "--device", "cpu", "--repeats", "1",
               "--warmup", "0", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    assert "| **step** |" in capsys.readouterr().out
