"""``flexsp profile`` before and around its sweep: states that cannot fit are refused before anything is
built or timed (with the ``--num-gpus`` that would fit), CPU runs default to one thread and the CPU clock,
the sweep's duration is estimated up front, and a fit too noisy to plan with is refused without ``--force``."""
import argparse

import pytest

torch = pytest.importorskip("torch")

from flexsp import CostModel  # noqa: E402
from flexsp.plan.specs import get_model  # noqa: E402
from flexsp.profile import compute  # noqa: E402
from flexsp.profile import memory as profile_memory  # noqa: E402
from flexsp.profile.preflight import FIT_ERROR_LIMIT  # noqa: E402
from flexsp.profile.preflight import fitting_gpus  # noqa: E402

from flexsp.profile import cli  # noqa: E402

TINY = ["--model", "tiny", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
        "--vocab", "64", "--device", "cpu", "--threads", "1", "--clock", "cpu", "--statistic", "min",
        "--repeats", "2", "--warmup", "1", "--quiet"]


def _run(argv):
    parser = argparse.ArgumentParser(prog="flexsp")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    threads = torch.get_num_threads()
    try:
        return cli.run(parser.parse_args(["profile", *argv]))
    finally:
        torch.set_num_threads(threads)   # --threads (and the CPU default of 1) is process-wide

H200 = 141e9   # bytes, the faked device memory
SWEEP = ["--lengths", "32,64,128,192,256", "--memory-lengths", "64,128", "--memory-gb", "1"]


@pytest.fixture
def no_sweep(monkeypatch):
    """A device of ``H200`` bytes whose model must never be built (building llama3-8b takes 32 GB of RAM)."""
    monkeypatch.setattr(profile_memory, "device_memory_bytes", lambda device: H200)

    def refuse(*args, **kwargs):
        raise AssertionError("the profiler built the model although its states cannot fit")
    monkeypatch.setattr(compute, "GroupRunner", refuse)


def test_llama3_8b_at_world_one_is_refused_before_the_sweep_with_the_gpus_that_fit(no_sweep, tmp_path, capsys):
    assert _run(["--model", "llama3-8b", "--device", "cpu", "-o", str(tmp_path / "c.json")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "compute:" not in captured.out
    assert "sharding 'full' over 1 GPU(s)" in err and "--num-gpus 2 would fit" in err
    assert not (tmp_path / "c.json").exists()
    # sharding "none" never fits by adding GPUs: the line says what would
    assert _run(["--model", "llama3-8b", "--device", "cpu", "--sharding", "none", "--num-gpus", "8"]) == 2
    assert "no number of GPUs fits with sharding 'none'; --sharding full --num-gpus 2 would" in capsys.readouterr().err


def test_fitting_gpus_is_the_fewest_that_fit():
    spec = get_model("llama3-70b")
    usable = 0.9 * 80e9
    n = fitting_gpus(spec, "full", usable)
    assert n is not None and n > 1
    assert 16 * spec.params / n < usable <= 16 * spec.params / (n - 1) + 34 * spec.hidden * spec.layers
    assert fitting_gpus(spec, "none", usable) is None


def test_cpu_defaults_are_one_thread_and_the_cpu_clock_and_the_sweep_is_estimated(tmp_path, capsys):
    argv = [a for a in TINY if a != "--quiet"]
    for flag in ("--threads", "--clock"):
        i = argv.index(flag)
        del argv[i:i + 2]
    assert _run([*argv, *SWEEP, "--force", "-o", str(tmp_path / "c.json")]) == 0
    meta = CostModel.load(tmp_path / "c.json").meta
    assert meta["clock"] == "cpu" and meta["threads"] == 1
    out = capsys.readouterr().out
    before, after = [line for line in out.splitlines() if line.startswith("estimate:")]
    assert out.index(before) < out.index(after) < out.index("compute:")   # both before the sweep's lengths
    assert "the sweep takes at least" in before and "TFLOP/s of a bare matmul" in before
    assert "5 lengths x 3 runs + 2 memory runs; one 32-token run took" in after


@pytest.fixture
def noisy(monkeypatch):
    """Timings that no alpha-beta curve fits (every other length twice as slow)."""
    def time_group(self, lengths, *, repeats=3, **kwargs):
        n = int(sum(lengths))
        return [1e-3 * (1 + n / 64) * (2.0 if n % 64 else 1.0) * (1 + n / 1e4)] * repeats
    monkeypatch.setattr(compute.GroupRunner, "time_group", time_group)


def test_a_fit_above_the_error_limit_is_refused_without_force(noisy, tmp_path, capsys):
    out = tmp_path / "c.json"
    assert _run([*TINY, *SWEEP, "--lengths", "32,64,96,128,160,192", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"above the {FIT_ERROR_LIMIT:.0%} limit" in err and "--force writes it anyway" in err and not out.exists()
    assert _run([*TINY, *SWEEP, "--lengths", "32,64,96,128,160,192", "--force", "-o", str(out)]) == 0
    meta = CostModel.load(out).meta
    assert any("error limit" in e for e in meta["estimates"])
