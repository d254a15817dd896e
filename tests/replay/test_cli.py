"""``flexsp replay``, ``flexsp simulate --replay`` and the CPU benchmark's quick mode, end to end."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")

import flexsp  # noqa: E402
from flexsp.cli import main  # noqa: E402
from flexsp.profile.shape import model_spec  # noqa: E402
from scripts import run_script  # noqa: E402

MICRO = model_spec(None, layers=1, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64)


@pytest.fixture()
def files(tmp_path):
    cost = flexsp.CostModel(alpha1=2e-7, alpha2=1e-5, beta1=0.01, comm_bytes_per_token=768.0, token_capacity=256,
                            alltoall_bandwidth={2: 2e8, 4: 1.5e8, 8: 1e8}, meta={"model": dict(MICRO.__dict__, name="micro")})
    cost.save(tmp_path / "cost.json")
    lengths = np.random.default_rng(3).integers(8, 300, 8)
    np.savetxt(tmp_path / "lengths.txt", lengths, fmt="%d")
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(4, 4), "flexsp", time_limit=0.3)
    plan.save(tmp_path / "plan.json")
    return tmp_path, plan


def test_replay_command_writes_table_json_and_gantt(files, capsys):
    tmp, plan = files
    rc = main(["replay", str(tmp / "plan.json"), "--lengths", str(tmp / "lengths.txt"), "--cost", str(tmp / "cost.json"),
               "--repeats", "1", "--warmup", "0", "--device", "cpu", "--json", str(tmp / "r.json"),
               "--markdown", str(tmp / "r.md"), "--gantt", str(tmp / "r.png"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| **step** |" in out and "measured compute on cpu" in out
    data = json.loads((tmp / "r.json").read_text())
    assert len(data["groups"]) == sum(len(mb.groups) for mb in plan.micro_batches)
    assert data["step"]["predicted_time"] == pytest.approx(plan.predicted_time)
    assert data["meta"]["model"]["hidden"] == 32 and data["meta"]["device_type"] == "cpu"
    assert "| micro-batch | group |" in (tmp / "r.md").read_text()
    assert (tmp / "r.png").stat().st_size > 5000
    from flexsp.evaluation.plots import png_provenance
    assert png_provenance(tmp / "r.png")["Source"] == "flexsp replay"   # as every FlexSP plot says where it came from


def test_replay_command_refuses_another_model_shape_and_batch(files, capsys):
    tmp, _ = files
    common = ["replay", str(tmp / "plan.json"), "--cost", str(tmp / "cost.json"), "--device", "cpu", "--quiet"]
    assert main(common + ["--lengths", str(tmp / "lengths.txt"), "--model", "tiny"]) == 2
    assert "error: cost model was measured for model 'micro'" in capsys.readouterr().err
    assert main(common + ["--lengths", str(tmp / "lengths.txt"), "--heads", "2", "--kv-heads", "2"]) == 2
    assert "error:" in capsys.readouterr().err
    np.savetxt(tmp / "short.txt", [5, 6], fmt="%d")
    assert main(common + ["--lengths", str(tmp / "short.txt")]) == 2
    assert "another batch" in capsys.readouterr().err
    (tmp / "bw.json").write_text('{"1": 1e9}')
    assert main(common + ["--lengths", str(tmp / "lengths.txt"), "--bandwidth", str(tmp / "bw.json")]) == 2
    assert "needs a degree >= 2" in capsys.readouterr().err
    (tmp / "bad.json").write_text('{"num_gpus": 4}')
    assert main(["replay", str(tmp / "bad.json"), "--lengths", str(tmp / "lengths.txt"), "--cost",
                 str(tmp / "cost.json")]) == 2
    assert "missing 'predicted_time'" in capsys.readouterr().err


def test_replay_command_uses_a_measured_bandwidth_table(files, capsys):
    tmp, _ = files
    (tmp / "bw.json").write_text(json.dumps({"alltoall_bandwidth": {"2": 1e6, "4": 1e6}}))
    rc = main(["replay", str(tmp / "plan.json"), "--lengths", str(tmp / "lengths.txt"), "--cost", str(tmp / "cost.json"),
               "--bandwidth", str(tmp / "bw.json"), "--repeats", "1", "--warmup", "0", "--device", "cpu",
               "--json", str(tmp / "r.json"), "--quiet"])
    assert rc == 0
    data = json.loads((tmp / "r.json").read_text())
    assert "measured table" in data["meta"]["label"]
    for g in data["groups"]:
        assert g["comm"] == pytest.approx(0 if g["degree"] == 1 else 768.0 * g["tokens"] / g["degree"] / 1e6)


def test_simulate_replay_adds_measured_compute_columns(files, capsys):
    tmp, _ = files
    rc = main(["simulate", "--cost", str(tmp / "cost.json"), "--gpus", "4", "--gpus-per-node", "4", "--context", "1K",
               "--batch-size", "6", "--steps", "2", "--strategies", "flexsp,static:4", "--time-limit", "0.3",
               "--replay", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--quiet",
               "--json", str(tmp / "sim.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "replayed total (s) | flexsp speedup (replayed) |" in out and "replayed: measured compute" in out
    rows = [line for line in out.splitlines() if line.startswith("| flexsp |") or line.startswith("| static:4 |")]
    assert len(rows) == 2 and all(len(r.split("|")) == 14 for r in rows)   # 12 columns, the coupled bound among them
    replayed = json.loads((tmp / "sim.json").read_text())["replayed"]["totals"]
    assert set(replayed) == {"flexsp", "static:4"} and all(v > 0 for v in replayed.values())


def test_simulate_replay_skips_strategies_the_model_cannot_run(files, capsys):
    tmp, _ = files
    rc = main(["simulate", "--cost", str(tmp / "cost.json"), "--gpus", "8", "--gpus-per-node", "8", "--context", "1K",
               "--batch-size", "4", "--steps", "1", "--strategies", "flexsp[1,2,4],static:8", "--time-limit", "0.3",
               "--replay", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "static:8 not replayed: micro-batch 0 group 0: Ulysses SP degree 8 does not divide the 4" in captured.err
    static = next(line for line in captured.out.splitlines() if line.startswith("| static:8 |"))
    assert static.rstrip().endswith("| not replayed |")   # no flexsp run, so no speedup column after it


def test_benchmark_quick_mode(tmp_path):
    run_script("replay_benchmark", "--quick", "--out", tmp_path)
    markdown = (tmp_path / "replay_cpu.md").read_text()
    assert "quick mode" in markdown and "Measured on a CPU" in markdown and "| flexsp |" in markdown
    data = json.loads((tmp_path / "replay_cpu.json").read_text())
    assert data["rows"][0]["strategy"] == "flexsp" and data["rows"][0]["replayed (s)"] > 0
    assert (tmp_path / "replay_cpu.png").stat().st_size > 5000
    assert "| SP degree |" in markdown
    assert json.loads((tmp_path / "replay_cpu_bandwidth.json").read_text())["alltoall_bandwidth"]["2"] > 0
