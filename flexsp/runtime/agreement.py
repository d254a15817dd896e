"""Rank agreement on a side channel: every rank learns, in bounded time, whether any rank failed.

A rank that raises and leaves a collective makes the others wait until the backend's timeout (NCCL's
default is ten minutes, often raised to hours). ``ControlGroup`` is a gloo group with its own,
user-set timeout for small host-side agreements: each rank reports its outcome of a phase (loading a
step, writing a checkpoint) and every rank raises the same error if any rank failed, or a clear
timeout error if some rank never arrived (hung or dead). gloo keeps these tiny exchanges on the host,
off the GPU stream, whatever the training backend.

Used by the loader (plan broadcast, data errors) and by checkpoints. The executor's step uses
``flexsp.runtime.failures`` instead (``agree`` on the training group, ``FailureChannel`` inside a
step): its checks are local, so every rank arrives and no timeout or extra group is needed there;
that module's docstring says why the two are not merged.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import FlexSPError

DEFAULT_TIMEOUT = 300.0


class ControlGroup:
    """A gloo group over the whole world with ``timeout`` seconds per agreement. Build it on every rank
    at the same point (creation is collective). Without a process group it describes a world of one."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        if not timeout > 0:
            raise FlexSPError(f"agreement timeout must be > 0 seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
                      if self.distributed else None)

    def any(self, flag: bool, *, what: str = "agreement",
            error: Callable[[str], Exception] = FlexSPError) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.call(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group), what, error)
        return bool(t.item())

    def gather(self, value: object, *, what: str = "agreement",
               error: Callable[[str], Exception] = FlexSPError) -> list:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        out: list = [None] * self.world_size
        self.call(lambda: dist.all_gather_object(out, value, group=self.group), what, error)
        return out

    def check(self, failure: str | None, *, what: str,
              error: Callable[[str], Exception] = FlexSPError) -> None:
        """Raise ``error`` with one message on every rank if any rank passed a ``failure`` ("Type: msg").

        One int all-reduce when all went well; the messages are gathered only after a failure.
        """
        if not self.any(failure is not None, what=what, error=error):
            return
        failures = [(r, f) for r, f in enumerate(self.gather(failure, what=what, error=error)) if f is not None]
        rank, message = failures[0]
        also = f" (also failed on ranks {[r for r, _ in failures[1:]]})" if len(failures) > 1 else ""
        raise error(f"{what} failed on rank {rank}: {message}{also}")

    def call(self, op: Callable[[], object], what: str, error: Callable[[str], Exception] = FlexSPError) -> None:
        """Run a collective on ``self.group``; a timeout or a dead peer becomes ``error`` naming ``what``."""
        try:
            op()
        except RuntimeError as exc:   # gloo: timeout, or a peer's socket closed because it died
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise error(f"{what}: not every rank arrived within {self.timeout:g} s (a rank hung, crashed or "
                        f"left): {first}") from None

    def close(self) -> None:
        """Release the side group (local; call on every rank once it is no longer used)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
            self.distributed = False


def describe(exc: BaseException) -> str:
    """The one-line ``"Type: message"`` form an agreement carries."""
    return f"{type(exc).__name__}: {exc}"
