"""A checkpoint's CUDA generator is the rank's own device's, whatever the launcher makes visible.

Device numbers depend on the launch (torchrun: every GPU of the node visible, rank r on cuda:r; srun with one GPU
per task: one visible, every rank on cuda:0): a restart under another launcher must still give each rank its own
stream back, not device r's or an IndexError. No GPU here: ``torch.cuda``'s generator calls are stood in by
per-device states."""
import pytest

torch = pytest.importorskip("torch")

import flexsp.checkpoint.checkpointer as checkpointer  # noqa: E402


class _Devices:
    """``visible`` devices, each with its own generator state; ``current`` is the rank's."""

    def __init__(self, visible: int, current: int):
        self.states = [torch.tensor([i, 0], dtype=torch.uint8) for i in range(visible)]
        self.current = current

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[device].clone())
        monkeypatch.setattr(cuda, "set_rng_state", lambda state, device="cuda": self.states.__setitem__(device, state))
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(cuda, "set_rng_state_all",
                            lambda states: [self.states.__setitem__(i, s) for i, s in enumerate(states)])


@pytest.mark.parametrize("saved,restored", [((8, 3), (8, 3)), ((1, 0), (8, 3)), ((8, 3), (1, 0))],
                         ids=["same launch", "one visible, then eight", "eight visible, then one"])
def test_each_rank_gets_its_own_cuda_stream_back(monkeypatch, saved, restored):
    before = _Devices(*saved)
    before.states[before.current] = torch.tensor([99, 7], dtype=torch.uint8)   # this rank's advanced stream
    before.install(monkeypatch)
    state = checkpointer._rng_state()
    after = _Devices(*restored)
    after.install(monkeypatch)
    checkpointer._set_rng_state(state)
    assert after.states[after.current].tolist() == [99, 7]
    assert all(s.tolist() == [i, 0] for i, s in enumerate(after.states) if i != after.current)   # no other device


def test_a_checkpoint_of_the_earlier_format_restores_the_device_of_the_same_number(monkeypatch):
    """Earlier checkpoints hold every visible device's state by number: the rank takes its device's."""
    after = _Devices(8, 3)
    after.install(monkeypatch)
    old = {**checkpointer._rng_state(), "cuda": [torch.tensor([50 + i, 1], dtype=torch.uint8) for i in range(8)]}
    del old["cuda_device"]
    checkpointer._set_rng_state(old)
    assert after.states[3].tolist() == [53, 1]


@pytest.mark.parametrize("visible,current,want", [(1, 3, [50, 1]), (2, 5, None)],
                         ids=["one visible, then cuda:3", "two visible, then cuda:5"])
def test_earlier_checkpoints_saved_under_another_launcher_still_restore(monkeypatch, visible, current, want):
    """One saved device was the rank's own, whatever its number is now; several, and this device beyond them: the
    rank's CUDA stream starts afresh with a warning (as after a world-size change), the checkpoint still restores."""
    after = _Devices(8, current)
    after.install(monkeypatch)
    old = {**checkpointer._rng_state(), "cuda": [torch.tensor([50 + i, 1], dtype=torch.uint8) for i in range(visible)]}
    del old["cuda_device"]
    if want is None:
        with pytest.warns(UserWarning, match="starts afresh"):
            checkpointer._set_rng_state(old)
        assert after.states[current].tolist() == [current, 0]
    else:
        checkpointer._set_rng_state(old)
        assert after.states[current].tolist() == want
