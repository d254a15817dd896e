"""Run a benchmark's worker on several gloo ranks in local processes and collect one result per rank."""
from __future__ import annotations

import queue
import socket
import time
from typing import Any, Callable


def run_ranks(worker: Callable[..., None], world: int, args: tuple, timeout: float) -> dict[int, Any]:
    """Start ``worker(rank, port, *args, out)`` on ``world`` forkserver processes; each puts
    ``(rank, value)`` on ``out``. Returns what arrived within ``timeout`` seconds (a rank missing from
    the result hung or died); every process is joined or terminated before returning."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "flexsp.runtime"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
