"""``flexsp selftest --device cpu`` (what CI runs): kernels and the degree-1 step pass against their
references, CUDA-only checks are skipped, the JSON report is written; a wrong kernel fails it (exit 1)
and a bad argument is one line (exit 2)."""
import json

import pytest

torch = pytest.importorskip("torch")

import flexsp.runtime.kernels as kernels  # noqa: E402
from flexsp.cli import main  # noqa: E402

ARGS = ["selftest", "--device", "cpu", "--tokens", "64", "--repeats", "1"]


def test_selftest_on_cpu_passes_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "selftest.json"
    assert main([*ARGS, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    status = {c["check"]: c["status"] for c in report["checks"]}
    assert status == {"kernels": "pass", "step": "pass", "memory": "skip", "host syncs": "skip", "all-to-all": "skip"}
    step = next(c for c in report["checks"] if c["check"] == "step")
    assert step["speed_ratio"] > 0 and step["loss_gap"] < 1e-4
    assert "plain / flexsp time" in capsys.readouterr().out


def test_a_wrong_kernel_fails_the_selftest(tmp_path, monkeypatch):
    real = kernels.attend
    monkeypatch.setattr(kernels, "attend", lambda *a, **k: real(*a, **k) * 1.01)
    assert main([*ARGS, "--output", str(tmp_path / "r.json")]) == 1
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert checks[0]["check"] == "kernels" and checks[0]["status"] == "FAIL"


def test_bad_device_is_one_line(capsys):
    assert main(["selftest", "--device", "tpu"]) == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err


def test_under_torchrun_every_rank_checks_and_the_all_to_all_runs(tmp_path):
    """``torchrun -m flexsp selftest`` (the docstring's check 5): each rank runs the step checks as a world of
    one on its own device, then joins the launch's world; the round trip passes and every rank's report is kept
    (rank 0's at --output). Before, every rank skipped the all-to-all (and, on CUDA, all of them used cuda:0)."""
    import subprocess

    from scripts import experiment
    launcher, env = experiment("launch").torchrun(2)
    out = tmp_path / "selftest.json"
    proc = subprocess.run([*launcher, "-m", "flexsp", *ARGS, "--output", str(out)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for rank, path in enumerate((out, tmp_path / "selftest.rank1.json")):
        report = json.loads(path.read_text())
        checks = {c["check"]: c for c in report["checks"]}
        assert report["rank"] == rank and report["world_size"] == 2
        assert checks["all-to-all"]["status"] == "pass" and "round trip over 2 ranks exact" in checks["all-to-all"]["detail"]
        assert checks["step"]["status"] == "pass"


def test_a_shell_that_only_exports_world_size_is_no_launch(monkeypatch):
    """Batch scripts export WORLD_SIZE for the job: one selftest run there must not wait to join ranks that
    never come (a torchrun launch also sets LOCAL_RANK, MASTER_ADDR and MASTER_PORT)."""
    from flexsp.profile.selftest import launched_ranks
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launched_ranks() == (0, 0, 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("RANK", "10")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launched_ranks() == (10, 2, 8)
