"""One process: save/restore round trips, SIGTERM, atomic commit and fallback to the previous checkpoint."""
import os
import signal
import warnings

import pytest

torch = pytest.importorskip("torch")

from fault.common import SeenCounter, build, dataset, flat_params, train_step  # noqa: E402
from flexsp.checkpoint import (  # noqa: E402
    Checkpointer,
    CheckpointError,
    layout,  # noqa: E402
)
from flexsp.plan.specs import ModelSpec


def _run(directory, stop_after=None, restore=True, every=2, signal_at=None):
    """Train the single-rank job for one epoch with checkpoints; returns (params, counter, steps run)."""
    data = dataset(30)
    model, opt, loader, executor = build(1, data)
    seen = SeenCounter(len(data))
    ran = 0
    with loader, Checkpointer(directory, model, opt, loader=loader, every=every, extra={"seen": seen}) as ckpt:
        if restore:
            ckpt.restore()
        for step in loader:
            train_step(executor, step, data)
            seen.add(step.indices)
            ran += 1
            torch.rand(1)   # RNG use that a restore must replay
            if signal_at is not None and ckpt.step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if ckpt.step_done():
                break
            if stop_after is not None and ckpt.step == stop_after:
                break
        return flat_params(model), seen.counts.clone(), ran, ckpt.step, torch.rand(3)


def test_restore_continues_exactly_like_an_uninterrupted_run(tmp_path):
    full, full_seen, _, steps, _ = _run(tmp_path / "a", restore=False, every=0)
    _run(tmp_path / "b", stop_after=3)                 # saved at step 2; step 3 is lost with the "crash"
    assert [s for s, _ in layout.committed(tmp_path / "b")] == [2]
    resumed, seen, ran, end, _ = _run(tmp_path / "b")
    assert end == steps and ran == steps - 2
    assert torch.equal(resumed, full)                  # fp64, deterministic: bit for bit
    assert seen.tolist() == [1] * len(seen) == full_seen.tolist()


def test_sigterm_saves_and_stops_at_the_next_step_boundary(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    _, _, ran, end, rng_after = _run(tmp_path, every=0, signal_at=2)
    assert ran == 2 and end == 2
    assert signal.getsignal(signal.SIGTERM) == before          # the handler is put back on close
    assert [s for s, _ in layout.committed(tmp_path)] == [2]
    data = dataset(30)
    model, opt, loader, _ = build(1, data)
    with loader, Checkpointer(tmp_path, model, opt, loader=loader, extra={"seen": SeenCounter(30)}) as ckpt:
        assert ckpt.restore() == 2
        assert loader.state_dict()["index"] == 2
        assert torch.equal(torch.rand(3), rng_after)             # the RNG stream continues from the save


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path):
    _run(tmp_path, stop_after=4, every=2)
    assert [s for s, _ in layout.committed(tmp_path)] == [4, 2]
    (tmp_path / layout.partial_name(6)).mkdir()        # a save that died before its commit
    (tmp_path / layout.partial_name(6) / "__0_0.distcp").write_bytes(b"half")
    data = dataset(30)
    model, opt, loader, _ = build(1, data)
    with loader, Checkpointer(tmp_path, model, opt, loader=loader, extra={"seen": SeenCounter(30)}) as ckpt:
        assert ckpt.restore() == 4
        ckpt.save()                                    # the next save clears the leftover
    assert layout.leftovers(tmp_path) == []


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    _run(tmp_path, stop_after=4, every=2)
    newest = tmp_path / layout.final_name(4)
    victim = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    data = dataset(30)
    model, opt, loader, _ = build(1, data)
    with loader, Checkpointer(tmp_path, model, opt, loader=loader, extra={"seen": SeenCounter(30)}) as ckpt:
        with pytest.warns(UserWarning, match="SHA-256 mismatch"):
            assert ckpt.restore() == 2
        with pytest.raises(CheckpointError, match=f"{victim.name}: SHA-256 mismatch"):
            ckpt.restore(newest)


def test_a_different_model_is_refused_with_the_parameter_named(tmp_path):
    _run(tmp_path, stop_after=2, every=2)
    from flexsp.runtime import TinyLM
    other = TinyLM(ModelSpec(vocab=97, hidden=32, layers=1, heads=4, kv_heads=2,
                               ffn=32, tie_embeddings=True)).double()
    opt = torch.optim.Adam(other.parameters())
    with Checkpointer(tmp_path, other, opt, extra={"seen": SeenCounter(30)}) as ckpt:
        with pytest.raises(CheckpointError, match=r"parameter 'embed.weight' is \[97, 16\] in the checkpoint"):
            ckpt.restore()


def test_no_checkpoint_means_step_zero_and_bad_settings_are_named(tmp_path):
    data = dataset(30)
    model, opt, loader, _ = build(1, data)
    with loader, Checkpointer(tmp_path / "none", model, opt, loader=loader) as ckpt:
        assert ckpt.restore() == 0
    with pytest.raises(CheckpointError, match="every must be"):
        Checkpointer(tmp_path, model, opt, every=-1)
    with pytest.raises(CheckpointError, match="needs state_dict"):
        Checkpointer(tmp_path, model, opt, extra={"x": 3})
