"""The compute sweep and memory profile run on CPU with a tiny model; layer extrapolation is consistent."""
import warnings

import pytest

torch = pytest.importorskip("torch")

from flexsp.profile import model_spec  # noqa: E402
from flexsp.profile.compute import DeviceSetup, GroupRunner, compute_sweep  # noqa: E402
from flexsp.profile.fit import FitWarning, fit_compute  # noqa: E402
from flexsp.profile.memory import activation_profile, capacity  # noqa: E402

SPEC = model_spec("tiny", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
CPU = DeviceSetup.resolve("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Two threads on two shared cores stall each other at every op barrier; one is steadier and faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_setup_resolves_cpu_fp32():
    assert CPU.device.type == "cpu" and CPU.dtype == torch.float32 and CPU.bytes_per_element == 4
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        DeviceSetup.resolve("cpu", "int8")
    with pytest.raises(ValueError, match="unknown clock"):
        GroupRunner(SPEC, CPU, clock="sundial")


def test_compute_sweep_runs_and_fits():
    runner = GroupRunner(SPEC, CPU, clock="cpu")
    lengths = [16, 32, 64, 128, 192]
    sweep = compute_sweep(runner, lengths, repeats=2, warmup=1)
    assert sorted(set(sweep.lengths)) == lengths and len(sweep.seconds) == 2 * len(lengths)
    assert all(t > 0 for t in sweep.seconds)
    with warnings.catch_warnings():   # tiny lengths on a shared CPU: a term may well fit to 0
        warnings.simplefilter("ignore", FitWarning)
        fit = fit_compute(sweep.lengths, sweep.seconds, statistic="min")
    assert len(fit.points) == len(lengths) and (fit.alpha1 > 0 or fit.alpha2 > 0)


def test_layer_extrapolation_weights():
    runner = GroupRunner(model_spec("tiny", layers=8, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64), CPU,
                         run_layers=2)
    (big, w_big), (base, w_base) = runner.models()
    assert len(big.blocks) == 2 and len(base.blocks) == 0
    assert (w_big, w_base) == (4.0, -3.0)          # full = base + 4 * (2 blocks - base)
    assert GroupRunner(SPEC, CPU, run_layers=99).run_layers == SPEC.layers


def test_memory_estimate_extrapolates_layers_exactly():
    # Saved-tensor bytes are deterministic and blocks identical: 1 block x2 must equal 2 blocks.
    full = activation_profile(GroupRunner(SPEC, CPU), [32, 64, 128])
    scaled = activation_profile(GroupRunner(SPEC, CPU, run_layers=1), [32, 64, 128])
    assert full.estimate and "estimate" in full.method
    assert full.bytes_per_token > 0
    assert scaled.activation_bytes == pytest.approx(full.activation_bytes, rel=1e-9)
    assert list(full.activation_bytes) == sorted(full.activation_bytes)
    cap = capacity(SPEC.params, full.bytes_per_token, 2**30, sharding="full", num_gpus=4)
    assert cap.model_state_bytes == pytest.approx(SPEC.params * 16 / 4)
    assert cap.token_capacity == int((0.9 * 2**30 - cap.model_state_bytes) // full.bytes_per_token)
    with pytest.raises(ValueError, match="at least 2 distinct lengths"):
        activation_profile(GroupRunner(SPEC, CPU), [64, 64])
