"""The GPU hand-over of a prefetched step, checked without a GPU (issue 36, point 4): the preparation runs
on the side stream, the caller's stream waits for it by an event (no host sync), and every CUDA tensor
of the step, however deep (a ring context's tensors too), is marked as used on the caller's stream so
the caching allocator cannot give its memory back to the side stream early. ``torch.cuda`` is stood in
for by recorders, and "CUDA tensors" by a tensor subclass that says it is one."""
import threading
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from flexsp.data.prefetch import Prefetch, device_tensors  # noqa: E402


class FakeCudaTensor(torch.Tensor):
    marked: list = []

    @property
    def is_cuda(self):
        return True

    def record_stream(self, stream):
        FakeCudaTensor.marked.append((id(self), stream))


class FakeStream:
    def __init__(self, name):
        self.name, self.device, self.waited = name, torch.device("cuda", 0), []

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def record(self, stream=None):
        self.stream = stream


@dataclass(frozen=True)
class Ring:
    tensors: tuple


@dataclass(frozen=True)
class Shard:
    input_ids: torch.Tensor
    host: torch.Tensor
    ring: Ring | None


@dataclass(frozen=True)
class FakeStep:
    micro_batches: tuple


def _cuda(n):
    return torch.zeros(n).as_subclass(FakeCudaTensor)


def test_prepared_on_the_side_stream_and_handed_to_the_callers_stream(monkeypatch):
    side, main = FakeStream("side"), FakeStream("main")
    active = threading.local()

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            active.stream = self.stream

        def __exit__(self, *exc):
            active.stream = None

    class DeviceContext:
        def __init__(self, device):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    FakeCudaTensor.marked = []
    deep = [_cuda(2), _cuda(3)]
    step = FakeStep((Shard(_cuda(4), torch.zeros(4), Ring((tuple(deep),))), Shard(_cuda(5), torch.zeros(1), None)))
    seen = {}

    def prepare():
        seen["stream"] = getattr(active, "stream", None)
        seen["thread"] = threading.current_thread().name
        return step

    ahead = Prefetch(prepare, side)
    assert ahead.result() is step
    assert seen == {"stream": side, "thread": "flexsp-loader-prefetch"}   # prepared on the side stream, off-thread
    assert len(main.waited) == 1 and main.waited[0].stream is side        # the caller's stream waits for it
    cuda = [step.micro_batches[0].input_ids, *deep, step.micro_batches[1].input_ids]
    assert sorted(FakeCudaTensor.marked, key=lambda m: m[0]) == sorted(((id(t), main) for t in cuda),
                                                                      key=lambda m: m[0])
    assert len(list(device_tensors(step))) == 4   # host tensors are left alone


def test_on_a_cpu_there_is_no_stream_and_errors_reach_the_caller():
    assert Prefetch(lambda: 7).result() == 7

    def fails():
        raise ValueError("item 3 is unreadable")

    with pytest.raises(ValueError, match="item 3 is unreadable"):
        Prefetch(fails).result()
    assert not list(device_tensors(torch.zeros(3)))


class _Unwalkable(tuple):
    """A step's indices or lengths (131,072 ints at scale): walking them for tensors costs the training thread."""

    def __iter__(self):
        raise AssertionError("walked a host-only field")


def test_the_walk_for_device_tensors_skips_a_steps_host_only_fields():
    from flexsp import Plan
    from flexsp.runtime.step import Step
    host = _Unwalkable(range(5))
    step = Step(epoch=0, index=0, step=0, plan=Plan(num_gpus=1, predicted_time=0.0, micro_batches=()), indices=host,
                lengths=host, num_tokens=0, loss_tokens=0, micro_batches=(Shard(_cuda(4), torch.zeros(4), None),),
                last=False, plan_wait=0.0, load_seconds=0.0, fallback=False)
    assert [t.shape for t in device_tensors(step)] == [torch.Size([4])]
