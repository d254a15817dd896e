"""A tiny elastic launcher for the crash tests: start N gloo ranks, SIGKILL one on cue, stop the rest
(as ``torchrun`` does when a worker dies), and relaunch. Every wait has a deadline."""
from __future__ import annotations

import os
import queue as queue_module
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from runtime.distributed import free_port


def _context():
    # the same forkserver as tests/runtime/distributed.py (one per test session): ranks fork from a
    # process that imported torch once
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "pytest", "flexsp.runtime"])
    return ctx


@dataclass(frozen=True)
class Attempt:
    """How one launch ended: values of the ranks that finished, exit codes, errors by rank."""

    values: dict[int, Any]
    exitcodes: dict[int, int | None]
    errors: dict[int, str]
    killed: int | None


def _plain(value: Any) -> Any:
    """Tensors as numpy copies: a tensor sent through a queue lives in the sender, which may exit first."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _entry(rank: int, world: int, port: int, pg_timeout: float, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        results.put((rank, _plain(fn(rank, world, *args)), None))
    except BaseException as exc:
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cue_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"cue-rank{rank}"


def launch(fn: Callable, world: int, *args: Any, timeout: float = 30.0, pg_timeout: float = 10.0,
           kill_rank: int | None = None, cue_dir: str | None = None, grace: float = 5.0) -> Attempt:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks. If ``kill_rank`` is set, SIGKILL that rank as soon
    as it creates its cue file (``cue_path(cue_dir, rank)``); then give the others ``grace`` seconds to
    fail on their own and terminate whoever is left, like an elastic agent tearing a job down."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, pg_timeout, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    values, errors, killed = {}, {}, None
    deadline = time.monotonic() + timeout
    torn_down_at = None
    try:
        while time.monotonic() < deadline:
            if kill_rank is not None and killed is None and cue_path(cue_dir, kill_rank).exists():
                os.kill(procs[kill_rank].pid, signal.SIGKILL)
                killed = kill_rank
                torn_down_at = time.monotonic() + grace
            try:
                rank, value, error = results.get(timeout=0.05)
                (errors if error else values)[rank] = error or value
            except queue_module.Empty:
                pass
            if all(p.exitcode is not None for p in procs) and results.empty():
                break
            if torn_down_at is not None and time.monotonic() > torn_down_at:
                break
        else:
            pytest.fail(f"launch did not finish within {timeout:.0f}s; ranks alive: "
                        f"{[r for r, p in enumerate(procs) if p.is_alive()]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
        results.close()
    return Attempt(values, {r: p.exitcode for r, p in enumerate(procs)}, errors, killed)
