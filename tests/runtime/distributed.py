"""Run a test function on N local processes joined by gloo, with a deadline instead of a hang.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group on a free port in each, calls ``fn(rank, world_size, *args)`` and returns the values
in rank order. Tensors in a returned value come back as numpy arrays. If any rank raises, the test
fails with that rank's traceback (or, with ``expect_errors=True``, the outcomes are returned). If
the ranks are not all done by ``timeout`` seconds, every process is terminated and the test fails.
"""
from __future__ import annotations

import queue as queue_module
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DEFAULT_TIMEOUT = 90.0


@dataclass(frozen=True)
class Outcome:
    """How one rank ended: its return value, or its error as ``"Type: message"`` plus traceback."""

    rank: int
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    traceback: str | None = None
    exitcode: int | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    # forkserver: children fork from a server that imported torch once (fast), never from pytest's
    # process (whose torch threads make fork unsafe). torch._dynamo is what the first optimizer
    # imports (over a second per process); pytest is what every test module imports.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pytest", "flexsp.runtime"])
    return ctx


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_plain(v) for v in value)
    return value


def _entry(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)   # several ranks share two cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put(Outcome(rank, value=_to_plain(value)))
    except BaseException as exc:  # report, then exit non-zero
        results.put(Outcome(rank, error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__,
                            traceback=traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
                    expect_errors: bool = False) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; values (or outcomes) by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world_size, port, timeout, fn, args, results), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                out = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                outcomes[out.rank] = out
            except queue_module.Empty:
                if time.monotonic() > deadline:
                    break
                if all(p.exitcode is not None for i, p in enumerate(procs) if i not in outcomes) and results.empty():
                    break   # ranks gone without reporting (segfault, killed, a result lost): nothing more will come
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        results.close()
    if hung or len(outcomes) < world_size:
        missing = sorted(set(range(world_size)) - set(outcomes))
        errors = "\n".join(o.traceback for o in outcomes.values() if o.traceback)
        if hung:
            pytest.fail(f"distributed run did not finish within {timeout:.0f}s: ranks {hung} were still running "
                        f"and were terminated\n{errors}")
        codes = {r: procs[r].exitcode for r in missing}
        pytest.fail(f"ranks {missing} exited without reporting (exit codes {codes}); see captured stderr\n{errors}")
    ordered = [Outcome(r, outcomes[r].value, outcomes[r].error, outcomes[r].error_type, outcomes[r].traceback,
                       procs[r].exitcode) for r in range(world_size)]
    if expect_errors:
        return ordered
    failed = [o for o in ordered if o.error]
    if failed:
        pytest.fail("\n".join(f"rank {o.rank} failed:\n{o.traceback}" for o in failed))
    return [o.value for o in ordered]
