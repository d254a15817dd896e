"""The right rank is blamed, and only the job can stop the job (issue 31, point 3).

A rank SIGKILLed inside a collective leaves no record: the survivors' collective breaks, and before
this the first survivor to post blamed itself. Now the dead rank is named by its stopped heartbeat on
every survivor. Records are signed with a secret the job agreed at start-up: a forged record or a
binary one written to the store by another process is logged and ignored, the watcher keeps going,
and a real failure still gets through. Each launch is a few seconds under a hard deadline."""
import json
import os
import signal
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from runtime.distributed import _context, free_port  # noqa: E402

DEADLINE = 60.0


def _entry(rank, world, port, fn, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    result = fn(rank, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)   # the world is broken in some tests: no teardown that could wait for the dead


def _launch(fn, world, tmp_path):
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, str(tmp_path)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} did not finish within {DEADLINE:.0f} s"
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in range(world) if (tmp_path / f"rank{r}.json").exists()}


def _killed(rank, world):
    from flexsp.runtime.failures import FailureChannel, RankFailure
    channel = FailureChannel("blame", silence=2.0)
    dist.barrier()
    time.sleep(1.0)                               # a few heartbeats from everyone
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)      # dies mid-step without a word
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))            # the step's collective: breaks when the peer's sockets close
        dist.all_reduce(torch.ones(1))
        return {"error": None}
    except RuntimeError as exc:
        recorded = channel.failure(wait=1.0) or channel.post(exc, "in step 0")
        return {"error": str(RankFailure(recorded)), "seconds": time.monotonic() - started}


def test_a_sigkilled_rank_is_named_on_every_survivor(tmp_path):
    out = _launch(_killed, 3, tmp_path)
    assert sorted(out) == [0, 1]
    for rank, result in out.items():
        assert result["error"] is not None and result["error"].startswith("rank 2 died in step 0"), result
        assert result["seconds"] < 60


def _forged(rank, world):
    from flexsp.runtime.failures import FailureChannel
    channel = FailureChannel("forge")
    key = channel._key
    dist.barrier()
    if rank == 0:   # any local process that can reach the store: a forged record, then a binary one
        store = dist.distributed_c10d._get_default_store()
        store.set(key, json.dumps({"rank": 1, "message": "stop the job", "mac": "0" * 64}))
    time.sleep(1.5)
    after_forged = channel.failure()
    if rank == 0:
        store.set(key, b"\xff\xfe\x00\x80 not utf-8")
    time.sleep(1.5)
    after_binary = channel.failure()
    watching = channel._thread.is_alive()
    dist.all_reduce(torch.ones(1))                # the job is not stopped: collectives still work
    dist.barrier()
    if rank == 1:                                 # a real failure replaces the squatter
        channel.post(ValueError("bad shard"), "in step 3")
    real = channel.failure(wait=10.0)
    channel.close()
    return {"forged": after_forged, "binary": after_binary, "watching": watching, "real": real}


def test_forged_and_binary_records_are_ignored_and_the_watcher_keeps_running(tmp_path, caplog):
    out = _launch(_forged, 2, tmp_path)
    assert sorted(out) == [0, 1]
    for result in out.values():
        assert result["forged"] is None and result["binary"] is None and result["watching"]
        assert result["real"] == "rank 1 failed in step 3: ValueError: bad shard"
