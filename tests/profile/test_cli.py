"""``flexsp profile`` end to end on CPU through ``flexsp.profile.cli`` (add_parser + run), tiny model."""
import argparse
import json

import pytest

torch = pytest.importorskip("torch")

from flexsp import CostModel  # noqa: E402
from flexsp.profile import cli  # noqa: E402

TINY = ["--model", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
        "--vocab", "64", "--device", "cpu", "--threads", "1", "--clock", "cpu", "--statistic", "min",
        "--repeats", "2", "--warmup", "1", "--quiet", "--force"]   # --force: a loaded CI box may fit above the error limit


def _run(argv):
    parser = argparse.ArgumentParser(prog="flexsp")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *argv])
    assert args.func is cli.run
    threads = torch.get_num_threads()
    try:
        return cli.run(args)
    finally:
        torch.set_num_threads(threads)   # --threads is process-wide; leave later tests as they were


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    rc = _run([*TINY, "--lengths", "32,64,128,192,256", "--memory-lengths", "64,128", "--memory-gb", "1",
               "--check", "auto", "-o", str(out / "cost.json"), "--report", str(out / "report.json")])
    assert rc == 0
    return out


def test_profile_writes_a_loadable_cost_model_with_provenance(profiled):
    cost = CostModel.load(profiled / "cost.json")
    meta = cost.meta
    assert meta["source"] == "flexsp profile" and meta["device_type"] == "cpu"
    assert meta["model"]["hidden"] == 32 and meta["torch"]
    assert "activation memory (CPU saved-tensor estimate)" in meta["estimates"]
    assert meta["label"].startswith("CPU profile")
    assert meta["check"]["groups"] >= 6 and meta["check"]["mean_abs_rel_error"] >= 0
    # one process: no all-to-all to measure, so every degree is filled from the default preset, marked
    assumed = meta["assumed"]
    assert assumed["interconnect"] == "nvlink-ib" and assumed["degrees"] == sorted(cost.alltoall_bandwidth)
    assert "interconnect (assumed: --interconnect nvlink-ib preset)" in meta["estimates"]
    assert cost.heads == 4 and cost.ring_bandwidth == 40e9 and cost.ring_hop_latency == 3 * 2 * 5e-6
    assert cost.comm_bytes_per_token == 2 * 2 * (2 * 32 + 2 * 16) * 4   # fp32 on CPU
    report = json.loads((profiled / "report.json").read_text())
    assert len(report["compute"]["points"]) == 5 and report["check"]["groups"]


def test_the_module_form_torchrun_uses_checks_a_saved_profile(profiled):
    """``torchrun -m flexsp.profile.cli profile ...`` runs the module as __main__: everything it calls must be
    defined before its entry point runs (a helper defined after the guard was a NameError at the end of a run)."""
    import os
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "flexsp.profile.cli", "profile", *TINY, "--cost",
                          str(profiled / "cost.json"), "--check", "auto"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-2000:]


def test_check_a_saved_profile_and_refuse_another_model_shape(profiled, tmp_path, capsys):
    cost = str(profiled / "cost.json")
    assert _run([*TINY, "--cost", cost, "--check", "auto"]) == 0
    other = [*TINY[:TINY.index("--hidden") + 1], "64", *TINY[TINY.index("--hidden") + 2:]]
    assert _run([*other, "--cost", cost, "--check", "auto"]) == 2
    assert "hidden: profile 32 vs planned 64" in capsys.readouterr().err
    assert _run([*other, "--cost", cost, "--check", "auto", "--allow-shape-mismatch"]) == 0


def test_bad_options_fail_with_a_message(tmp_path, capsys):
    assert _run([*TINY, "--lengths", "32,64,128", "-o", str(tmp_path / "c.json")]) == 2
    assert "at least 4 distinct sequence lengths" in capsys.readouterr().err
    assert _run([*TINY, "--cost", str(tmp_path / "c.json")]) == 2
    assert "--cost only makes sense with --check" in capsys.readouterr().err
    assert _run([*TINY, "--check", "plan.json", "--lengths", "32,64,96,128", "-o", str(tmp_path / "c.json")]) == 2
    assert "needs --check-lengths" in capsys.readouterr().err


def test_one_device_profile_is_usable_by_simulate(profiled, capsys):
    """The issue-27 symptom: a one-device profile used to fail simulate with "no all-to-all bandwidth
    for SP degree 2"; now it plans on 64 GPUs and says which parts are assumed."""
    from flexsp.cli import main
    code = main(["simulate", "--cost", str(profiled / "cost.json"), "--gpus", "64", "--steps", "1",
                 "--batch-size", "32", "--context", "256", "--quiet", "--strategies", "flexsp,batchada"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cost model parts: measured compute (alpha1, alpha2, beta1)" in out
    assert "ring bandwidth and hop latency from the nvlink-ib preset" in out


def test_interconnect_none_keeps_the_old_profile_and_a_bad_name_fails(tmp_path, capsys):
    rc = _run([*TINY, "--lengths", "32,64,128,192", "--memory-lengths", "64,128", "--memory-gb", "1",
               "--interconnect", "none", "-o", str(tmp_path / "c.json")])
    assert rc == 0 and CostModel.load(tmp_path / "c.json").alltoall_bandwidth == {}
    assert _run([*TINY, "--interconnect", "infiniband", "-o", str(tmp_path / "d.json")]) == 2
    assert "unknown interconnect 'infiniband'" in capsys.readouterr().err
