"""Run a benchmark's worker on several gloo ranks in local processes and collect one result per rank;
the free port and the torchrun command line that the scripts launching ranks share."""
from __future__ import annotations

import os
import queue
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int) -> tuple[list[str], dict[str, str]]:
    """The command prefix that starts a script on ``ranks`` local processes (plain ``python`` for one)
    and its environment: the checkout importable, one thread per rank, and no rank variables of a
    launch this process may itself run under."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    if ranks == 1:
        return [sys.executable], env
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}"], env


def run_ranks(worker: Callable[..., None], world: int, args: tuple, timeout: float) -> dict[int, Any]:
    """Start ``worker(rank, port, *args, out)`` on ``world`` forkserver processes; each puts
    ``(rank, value)`` on ``out``. Returns what arrived within ``timeout`` seconds (a rank missing from
    the result hung or died); every process is joined or terminated before returning."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "flexsp.runtime"])
    port = free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, value = out.get(timeout=1.0)
                results[rank] = value
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return results
