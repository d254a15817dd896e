"""``flexsp profile`` and ``selftest`` refuse a bad setting before measuring anything, in one line (found by
fuzzing the CLI: some were tracebacks, some surfaced only after the sweep, ``--help`` itself crashed)."""
import argparse
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from flexsp.profile import cli  # noqa: E402


def _run(argv, monkeypatch):
    """``flexsp profile ARGV`` with every measurement replaced by a failure: a check that comes too late fails."""
    import flexsp.profile.compute as compute
    monkeypatch.setattr(compute.DeviceSetup, "resolve", classmethod(lambda *a, **k: pytest.fail("measured first")))
    parser = argparse.ArgumentParser(prog="flexsp")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return cli.run(parser.parse_args(["profile", "--quiet", *argv]))


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--dtype", "bogus"], "--dtype must be auto or one of"),
    (["--run-layers", "0"], "--run-layers must be >= 1, got 0"),
    (["--num-gpus", "0"], "--num-gpus must be >= 1, got 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
    (["--usable", "2"], r"--usable must be a fraction in \(0, 1\], got 2.0"),
    (["--memory-gb", "-1"], "--memory-gb must be > 0 GiB, got -1.0"),
    (["-o", "/nonexistent/c.json"], "cannot write cost model /nonexistent/c.json"),
    (["--report", "/nonexistent/r.json"], "cannot write --report /nonexistent/r.json"),
    (["--lengths", "256"], "needs 2 distinct lengths, got [256] (the longest 3 of --lengths)"),
    (["--memory-lengths", "1K,1K"], "needs 2 distinct lengths, got [1024, 1024] (--memory-lengths)"),
])
def test_profile_refuses_a_bad_setting_before_measuring(argv, message, tmp_path, monkeypatch, capsys):
    argv = argv if "-o" in argv else [*argv, "-o", str(tmp_path / "c.json")]
    assert _run(argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexsp profile: error: ") and message.replace("\\", "") in err.replace("\\", "") \
        or pytest.fail(err)


def test_profile_cuda_without_a_gpu_is_one_line(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert _run(["--device", "cuda", "-o", str(tmp_path / "c.json")], monkeypatch) == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err


def test_profile_help_prints():
    out = subprocess.run([sys.executable, "-m", "flexsp", "profile", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "above 10% (it is refused otherwise" in " ".join(out.stdout.split())


def test_selftest_checks_its_output_before_the_checks(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flexsp", "selftest", "--device", "cpu", "--output",
                          str(tmp_path / "missing" / "s.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot write selftest report" in out.stderr and "Traceback" not in out.stderr


def test_simulate_caps_the_sequences_it_draws():
    out = subprocess.run([sys.executable, "-m", "flexsp", "simulate", "--gpus", "8", "--steps", str(10**12),
                          "--batch-size", "4", "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "over the cap of" in out.stderr and "--max-input sequences=N" in out.stderr


def test_profile_refuses_a_length_no_device_holds():
    """A length whose hidden states alone exceed the device's memory: one line, not the allocator's traceback."""
    out = subprocess.run([sys.executable, "-m", "flexsp", "profile", "--skip-comm", "--lengths", f"256,{10**12}",
                          "-o", "/dev/null"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--lengths: a 1,000,000,000,000-token sequence's hidden states alone need" in out.stderr


def test_selftest_on_the_cpu_refuses_what_its_memory_cannot_hold(tmp_path):
    """The CPU selftest sizes itself against the host's RAM as the CUDA one does against the GPU's: one line, not
    the allocator's traceback."""
    out = subprocess.run([sys.executable, "-m", "flexsp", "selftest", "--device", "cpu", "--tokens", str(10**12),
                          "--output", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "pick a smaller --shape or --tokens" in out.stderr
