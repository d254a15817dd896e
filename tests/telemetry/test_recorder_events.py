"""The GPU path's arithmetic, without a GPU: a step's CUDA events (stand-ins with the same
``elapsed_time`` / ``synchronize`` interface) become the same rank record fields as the CPU path."""
import pytest

pytest.importorskip("torch")

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.telemetry.recorder import PendingStep  # noqa: E402


class FakeEvent:
    def __init__(self, ms):
        self.ms, self.synced = ms, False

    def elapsed_time(self, other):   # milliseconds from self to other, like torch.cuda.Event
        return other.ms - self.ms

    def synchronize(self):
        self.synced = True


def test_events_become_seconds_idle_and_tail():
    plan = Plan(num_gpus=2, predicted_time=1.0, micro_batches=(MicroBatch((Group((0, 1), (0,)),)),
                                                               MicroBatch((Group((1,), (1,)),))))
    checked, end = FakeEvent(100.0), FakeEvent(900.0)
    marks = [[FakeEvent(110.0), FakeEvent(300.0), FakeEvent(500.0)],     # rank 0 in group 0
             [FakeEvent(500.0), FakeEvent(510.0), FakeEvent(800.0)]]     # rank 0 sits out micro-batch 1
    rank = {"rank": 0, "check_seconds": 0.25, "plan_wait": 0.0, "load_seconds": 0.0, "peak_memory_bytes": 1,
            "probe_seconds": 0.0, "seconds": None, "tail_seconds": None, "idle_seconds": None,
            "micro_batches": [{"group": 0, "tokens": 5, "busy": None}, {"group": None, "tokens": 0, "busy": None}]}
    out = PendingStep(plan, [10, 3], {}, rank, [checked, marks, end]).rank_record()
    assert end.synced
    assert [(m["start"], m["forward"], m["end"]) for m in out["micro_batches"]] == \
        [pytest.approx((0.01, 0.2, 0.4)), pytest.approx((0.4, 0.41, 0.7))]
    assert out["seconds"] == pytest.approx(0.25 + 0.8) and out["tail_seconds"] == pytest.approx(0.1)
    assert out["idle_seconds"] == pytest.approx(0.3)     # the micro-batch it sat out
    assert rank["seconds"] is None                        # the pending record itself is not modified


def test_tensorboard_asked_for_but_missing_is_a_named_error(tmp_path, monkeypatch):
    import builtins

    from flexsp.telemetry.records import TelemetryError
    from flexsp.telemetry.session import _summary_writer
    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard":
            raise ImportError("no tensorboard")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert _summary_writer(tmp_path, required=False) is None          # optional: quietly off
    with pytest.raises(TelemetryError, match="pip install tensorboard"):
        _summary_writer(tmp_path, required=True)
