"""A failure on one rank of four reaches every rank as the same error, in bounded time (no hang)."""
import dataclasses
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from flexsp import Cluster, CostModel, PlanError  # noqa: E402
from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError  # noqa: E402
from flexsp.runtime.failures import RankFailure  # noqa: E402
from flexsp.runtime.fsdp import shard_model  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402
from .test_executor import PLAN_A, _batch, _model  # noqa: E402

TIMEOUT = 60


class Dataset:
    """The test batch; item ``bad`` raises, but only when read on rank ``bad_rank``."""

    def __init__(self, bad=None, bad_rank=None):
        self.items, self.bad, self.bad_rank = [s.tolist() for s in _batch(0)], bad, bad_rank

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if i == self.bad and dist.get_rank() == self.bad_rank:
            raise OSError(f"disk read failed for item {i}")
        return self.items[i]


def _setup(dataset):
    pool = GroupPool()
    cost = CostModel(alpha1=1e-9, alpha2=1e-6, beta1=1e-4, comm_bytes_per_token=64.0,
                     alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=40)
    loader = FlexSPLoader(dataset, cost, Cluster(num_gpus=4, gpus_per_node=4),
                          LoaderConfig(batch_size=len(dataset), shuffle=False, lookahead=0), pool=pool,
                          planner=lambda lengths: PLAN_A, lengths=[len(x) for x in dataset.items])
    model = shard_model(_model(True), sharding="full", param_dtype=None)
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, cost=cost, backend="sdpa")
    return loader, executor


def _data_error_worker(rank, world_size):
    loader, _ = _setup(Dataset(bad=6, bad_rank=2))   # item 6 belongs to rank 2's degree-1 group
    with pytest.raises(LoaderError) as info:
        next(iter(loader))
    return str(info.value)


def _bad_shard_worker(rank, world_size):
    loader, executor = _setup(Dataset())
    step = next(iter(loader))
    if rank == 1:   # a shard cut wrong on one rank only
        mb = step.micro_batches[1]
        step = dataclasses.replace(step, micro_batches=(step.micro_batches[0],
                                                        dataclasses.replace(mb, input_ids=mb.input_ids[:-1]),
                                                        *step.micro_batches[2:]))
    with pytest.raises(PlanError) as info:
        executor.step(step)
    executor.step(next(iter(loader)))   # nobody entered a collective: the next step runs everywhere
    return str(info.value)


def _in_step_worker(rank, world_size):
    loader, executor = _setup(Dataset())
    if rank == 2:   # fails in layer 1 of micro-batch 2 (a degree-2 group with rank 3), collectives under way
        calls = []

        def boom(module, args):
            calls.append(1)
            if len(calls) == 3:   # layer 1 runs once per micro-batch
                raise RuntimeError("injected failure in layer 1")
        executor.model.blocks[1].register_forward_pre_hook(boom)
    step = next(iter(loader))
    start = time.monotonic()
    try:
        executor.step(step)
    except RankFailure as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start, "cause": type(exc.__cause__).__name__}
    return {"error": None}


def test_data_error_on_one_rank_is_raised_on_every_rank():
    messages = run_distributed(_data_error_worker, 4, timeout=TIMEOUT)
    assert len(set(messages)) == 1
    assert messages[0] == ("loading global batch 0 of epoch 0 failed on rank 2: LoaderError: dataset item 6 could not be "
                           "read: OSError: disk read failed for item 6")


def test_bad_shard_on_one_rank_is_raised_on_every_rank_before_collectives():
    messages = run_distributed(_bad_shard_worker, 4, timeout=TIMEOUT)
    assert len(set(messages)) == 1
    assert messages[0].startswith("rank 1: micro-batch 1: shard input_ids must be 1-D with")


def test_failure_inside_a_step_reaches_every_rank_without_hanging():
    results = run_distributed(_in_step_worker, 4, timeout=TIMEOUT)   # a hang fails the test at 60 s
    want = "rank 2 failed in step 0: RuntimeError: injected failure in layer 1"
    assert [r["error"] for r in results] == [want] * 4
    # Peers learn it from the failure record once their collective with rank 2 errors (gloo: the peer's
    # connection closes): seconds, not the process group's timeout.
    assert max(r["seconds"] for r in results) < 30
    assert results[2]["cause"] == "RuntimeError"


def _close_after_abort(rank, world_size):
    """After an NCCL failure the watcher aborts every group (``_abort_process_group`` empties c10d's registry;
    gloo has no abort, so the proxy destroys the world the same way): closing the loader's side group then
    must leave the caller's ``RankFailure`` in place."""
    from flexsp.runtime.failures import ControlGroup
    control = ControlGroup(30.0)
    dist.destroy_process_group()
    try:
        try:
            raise RankFailure("rank 1 failed in step 7")
        finally:
            control.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_closing_the_side_group_after_an_abort_keeps_the_callers_error():
    assert run_distributed(_close_after_abort, 2, timeout=TIMEOUT) == ["RankFailure: rank 1 failed in step 7"] * 2


@pytest.mark.parametrize("backend,cuda,nccl", [("nccl", True, True), ("gloo", True, False),
                                                ("cpu:gloo,cuda:nccl", True, True), ("undefined", True, True),
                                                ("undefined", False, False)])
def test_every_way_a_world_names_nccl_counts(monkeypatch, backend, cuda, nccl):
    """The failure watcher's NCCL abort and the pool's warm-up device follow NCCL wherever it serves CUDA
    tensors: a device map, or ``init_process_group()`` with no backend on a CUDA torch (lazy: NCCL for CUDA)."""
    from flexsp.runtime.failures import flag_device, runs_nccl
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert runs_nccl() is nccl
    if backend != "nccl":   # a CPU backend beside NCCL takes the agreement's CPU tensors
        assert flag_device() == torch.device("cpu")
