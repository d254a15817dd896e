"""What the recorder costs the training thread on a GPU, checked without one (issue 36, point 4): with
``torch.cuda`` stood in for by counters, the hooks of many steps create no CUDA event (they take them
from a pool the telemetry side refills), never call ``torch.cuda.max_memory_allocated`` (it flattens
every allocator statistic in Python), and still produce the same rank record."""
import pytest

torch = pytest.importorskip("torch")

import flexsp  # noqa: E402
from flexsp.telemetry import recorder as rec_mod  # noqa: E402
from flexsp.telemetry.recorder import StepRecorder  # noqa: E402


class FakeEvent:
    made = 0
    clock = 0.0

    def __init__(self, enable_timing=False):
        FakeEvent.made += 1
        self.ms = None

    def record(self, stream=None):
        FakeEvent.clock += 1.0
        self.ms = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.ms - self.ms


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.made, FakeEvent.clock = 0, 0.0
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: {"allocated_bytes": {"all": {"peak": 1234}}},
                        raising=False)

    def flattening(*a, **k):
        raise AssertionError("torch.cuda.max_memory_allocated called on the training thread")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", flattening)


def test_hooks_reuse_pooled_events_and_read_the_peak_directly(fake_cuda):
    cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=1024,
                            alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=256)
    lengths = [30, 50, 200, 120, 80, 40, 60, 90, 100, 20, 250, 33]
    plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(4, 4), strategy="greedy")
    batch = [torch.zeros(n) for n in lengths]   # run_plan's source: the sequences themselves
    pending = []
    recorder = StepRecorder(pending.append, rank=0, device="cuda")
    warm = FakeEvent.made
    assert warm > 0   # created when the recorder was built, not inside a step
    for _ in range(20):
        recorder.step_begin(plan, batch)
        recorder.checked()
        for m, mb in enumerate(plan.micro_batches):
            group = mb.group_of_rank(0)
            recorder.micro_batch_begin(m, group, 7)
            recorder.forward_end(m)
            recorder.micro_batch_end(m)
        recorder.step_end(None)
        record = pending.pop().rank_record()   # the telemetry thread's side: reads and returns the events
    assert FakeEvent.made == warm              # every mark of 20 steps used a pooled event
    assert record["peak_memory_bytes"] == 1234
    assert [mb["group"] for mb in record["micro_batches"]] == [
        next((j for j, g in enumerate(mb.groups) if 0 in g.ranks), None) for mb in plan.micro_batches]
    assert all(set(mb) == {"start", "forward", "end", "group", "tokens", "busy"} for mb in record["micro_batches"])
    assert record["seconds"] > 0 and record["probe_seconds"] >= 0


def test_telemetry_times_with_cuda_events_on_the_ranks_gpu_by_default(fake_cuda, monkeypatch, tmp_path):
    """``Telemetry(run_dir, cost)`` without ``device=`` on a GPU rank (the documented call): CUDA events on the
    rank's current device, not CPU time around asynchronous kernels; its thread reads them on that device (no
    CUDA context created on GPU 0 by every rank)."""
    from flexsp.telemetry import Telemetry
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    on = []
    monkeypatch.setattr(torch.cuda, "set_device", on.append)
    cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=1024,
                            alltoall_bandwidth={2: 1e9}, token_capacity=256)
    with Telemetry(tmp_path / "run", cost, log_every=0) as telemetry:
        assert telemetry.device == torch.device("cuda", 3) and telemetry.probe.cuda
    assert on == [torch.device("cuda", 3)]
