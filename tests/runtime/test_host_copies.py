"""No host-to-device copy from pageable memory in a step's packing (issue 35.5).

A pageable host-to-CUDA copy blocks the host until the GPU has drained its queue, so the step could
not run ahead of the device. ``set_sync_debug_mode`` needs a GPU; here every copy entry point
(``aten._to_copy``, ``aten.copy_``) is watched under ``FakeTensorMode`` with CUDA targets, pinning is
emulated (a CPU-only torch has no pinned allocator), and every host -> CUDA copy the packing makes
(Ulysses ``group_inputs``, the zigzag layout and ``RingTensors`` of a ring group, ``pack`` of
sequences already on the GPU, the idle rank's context) and every one a layer makes (a chunked layer's
bounds, ``by_sequence``'s index) must start from pinned memory with ``non_blocking=True``.
"""
import traceback

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flexsp.runtime.transfer as transfer  # noqa: E402
from flexsp.plan.types import Group  # noqa: E402
from flexsp.runtime.shard import group_inputs, pack  # noqa: E402
from flexsp.runtime.sp.context import AttentionContext  # noqa: E402
from flexsp.runtime.sp.zigzag import RingTensors, zigzag_layout  # noqa: E402

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten


class _HostToDevice(TorchDispatchMode):
    """Records (pinned, non_blocking, call site) for every host -> CUDA copy; emulates pin_memory."""

    def __init__(self):
        super().__init__()
        self.pinned = {}   # id -> tensor (kept alive, so an id is never reused while watched)
        self.copies = []

    def _record(self, src, non_blocking):
        site = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(traceback.extract_stack())
                     if "/flexsp/" in f.filename), "?")
        self.copies.append((id(src) in self.pinned, bool(non_blocking), site))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._pin_memory.default:
            out = args[0].clone()
            self.pinned[id(out)] = out
            return out
        if func is aten.is_pinned.default:
            return id(args[0]) in self.pinned
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if args[0].device.type == "cpu" and target is not None and torch.device(target).type == "cuda":
                self._record(args[0], kwargs.get("non_blocking", False))
        if func is aten.copy_.default and args[0].device.type == "cuda" and args[1].device.type == "cpu":
            self._record(args[1], args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return func(*args, **kwargs)


@pytest.fixture
def watch(monkeypatch):
    # a CPU-only torch cannot pin: take flexsp.runtime.transfer's CUDA branch (pin_memory is emulated by the watch)
    monkeypatch.setattr(transfer, "pinning_available", lambda device: device.type == "cuda")
    return _HostToDevice()


def _host_seqs(lengths):
    return [torch.arange(1, n + 1) for n in lengths]


def _host_packed_groups():
    """What a step builds for its groups on this rank from host sequences (``StepExecutor._pack``, the loader)."""
    shard, ctx = group_inputs(Group(ranks=(0, 1), seq_ids=(0, 1, 2)), _host_seqs([7, 3, 5]), 0, CUDA)   # Ulysses
    assert shard.input_ids.device == ctx.cu_seqlens.device == CUDA
    shard, ctx = group_inputs(Group(ranks=(0, 1, 2, 3), seq_ids=(0, 1), ring=2), _host_seqs([20, 9]), 2, CUDA)
    assert shard.labels.device == ctx.cu_seqlens.device == CUDA
    tensors = RingTensors.build(zigzag_layout([20, 9], 2, 2), 1, CUDA)   # what ring_context builds per micro-batch
    assert tensors.second_rows.device == CUDA
    AttentionContext.single(1, device=CUDA)   # an idle rank's one-token context (StepExecutor._idle)


def _device_sequences_packed():
    """``pack`` of sequences already on the GPU (``flexsp selftest``'s batch, a user's device batch)."""
    packed = pack([torch.arange(1, n + 1, device=CUDA) for n in (6, 4)], 2)
    assert packed.position_ids.device == packed.labels.device == CUDA


def _executor_step_up_to_forward(monkeypatch):
    """``StepExecutor.run_plan`` for a CUDA model up to its forward: checks, packing of every micro-batch
    (this rank's group, and an idle micro-batch's dummy), agreement. The model computes on the host here
    (a fake CUDA forward cannot run backward on a CPU-only torch), so the executor's device is set to
    CUDA after construction and the forward/backward is stopped where it would start."""
    from flexsp import MicroBatch, Plan
    from flexsp.plan.specs import ModelSpec
    from flexsp.runtime.models.tiny import TinyLM
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor

    model = TinyLM(ModelSpec(vocab=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64))
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), GroupPool(), backend="sdpa")
    executor.device = CUDA
    seen = []
    monkeypatch.setattr(executor, "_run", lambda work, denominator: seen.append(work))
    plan = Plan(num_gpus=1, predicted_time=0.0, micro_batches=(MicroBatch((Group((0,), (0, 2)),)),
                                                              MicroBatch((Group((0,), (1,)),))))
    executor.run_plan(plan, _host_seqs([9, 4, 6]))
    (work,) = seen
    assert [w.input_ids.device for w in work] == [CUDA, CUDA] and work[0].ctx.cu_seqlens.device == CUDA
    executor._dummy = None
    assert executor._idle().ctx.cu_seqlens.device == CUDA   # what an idle micro-batch runs


def _per_layer_bounds():
    """What a layer builds from host ints on every call: a chunked layer's cut bounds (``attend`` hands them to
    ``bounds_tensor``) and ``by_sequence``'s row index (the causal convolution; a recurrence without fla)."""
    from flexsp.runtime.kernels.layout import bounds_tensor
    from flexsp.runtime.sp.segments import by_sequence
    assert bounds_tensor((0, 16, 32, 40), 64, CUDA, "cu_seqlens").device == CUDA
    (out,) = by_sequence(lambda x: (x,), [torch.zeros(64, 8, device=CUDA)], (0, 40, 50, 60), 64)
    assert out.device == CUDA


def _pageable(watch):
    return [site for pinned, non_blocking, site in watch.copies if not (pinned and non_blocking)]


@pytest.mark.parametrize("packing,copies", [(_host_packed_groups, 8), (_device_sequences_packed, 3),
                                            (_executor_step_up_to_forward, 8), (_per_layer_bounds, 3)])
def test_the_step_packing_copies_to_cuda_only_from_pinned_memory(watch, packing, copies, monkeypatch):
    with FakeTensorMode(allow_non_fake_inputs=True), watch:
        packing(monkeypatch) if packing is _executor_step_up_to_forward else packing()
    assert len(watch.copies) >= copies, watch.copies   # the watch saw the copies (not a vacuous pass)
    assert _pageable(watch) == [], f"pageable or blocking host-to-device copies at {_pageable(watch)}"


def test_the_watch_catches_a_pageable_copy(watch):
    """The check itself: ``torch.tensor(..., device=cuda)`` (the old ``pack``) is a pageable copy."""
    with FakeTensorMode(allow_non_fake_inputs=True), watch:
        torch.tensor([0, 3, 5], dtype=torch.long, device=CUDA)
    assert [pinned for pinned, _, _ in watch.copies] == [False]
