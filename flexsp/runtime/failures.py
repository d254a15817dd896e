"""Failure agreement: an error on one rank reaches every rank as the same error, in bounded time.

Three mechanisms, one per situation:

* **Before any step collective** (plan, pool, heads, capacity, sharding, the rank's shards): every rank
  checks locally, then ``agree`` runs one small collective on the *training* group that every rank
  reaches whatever its checks said (a flag all-reduce; only on failure an ``all_gather_object`` of the
  messages). If any rank failed, every rank raises the same error (the lowest failing rank's, same
  type when it is a flexsp error) and the world stays usable. No timeout is needed: the checks
  before it are local, so every rank arrives; no extra communicator either.
* **Host-side phases where a rank may not arrive** (a data read or a checkpoint write that hangs or
  dies): ``ControlGroup`` is a gloo side group with a user-set timeout, created collectively up
  front; each rank reports its outcome and every rank raises "<phase> failed on rank r" in the
  caller's error class, or a timeout error naming the phase. gloo keeps these exchanges on the host.
* **Inside a step** (forward/backward collectives have begun): peers of a failed rank are blocked
  in a collective it will never join. ``FailureChannel`` records the first failure in the c10d
  store; a watcher thread on every rank sees it at once, acknowledges it and, on NCCL, aborts the
  local communicators so a blocked collective returns. On gloo an abort cannot unblock a
  collective: peers return when the failed process exits (its sockets close: immediate) or at the
  process group's timeout. Either way each rank then raises ``RankFailure`` with the recorded
  message. The world is unusable afterwards: let the exception end the process (torchrun restarts).
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from flexsp.errors import FlexSPError

_POLL_SECONDS = 0.5   # how often each rank's watcher asks the store for a failure record
DEFAULT_TIMEOUT = 300.0   # seconds a ControlGroup waits for every rank to report a phase


class RankFailure(FlexSPError):
    """Some rank failed during a step; every rank raises this with the same message."""


def error_report(exc: BaseException) -> dict[str, str]:
    """An error as the JSON-safe dict ``agree`` gathers (its type is rebuilt on the receiving ranks)."""
    return {"type": type(exc).__name__, "module": type(exc).__module__, "message": str(exc)}


def _flexsp_error_class(module: str, name: str) -> type[FlexSPError] | None:
    """The flexsp error class of that name, so an agreed error keeps its type (PlanError stays PlanError)."""
    stack = [FlexSPError]
    while stack:
        cls = stack.pop()
        if cls.__module__ == module and cls.__name__ == name:
            return cls
        stack.extend(cls.__subclasses__())
    return None


def _agreed_error(reports: list[dict[str, str] | None]) -> FlexSPError:
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    first_rank, first = failed[0]
    same = all(rep == first for _, rep in failed)
    if same and len(failed) == len(reports):
        message = first["message"]                        # every rank found the same problem
    else:
        others = [r for r, _ in failed[1:]]
        message = f"rank {first_rank}: {first['message']}" + (f" (ranks {others} failed too)" if others else "")
    cls = _flexsp_error_class(first["module"], first["type"])
    if cls is not None:
        try:
            return cls(message)
        except Exception:
            pass
    return RankFailure(f"rank {first_rank}: {first['type']}: {first['message']}")


def flag_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a world collective must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group`` (default: the world): raise the same error on every rank if any rank
    passes an ``error``; return on every rank if none does. One flag all-reduce (one host sync) when
    all is well. Call it where every rank is sure to arrive: after purely local checks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, None if error is None else error_report(error), group=group)
    agreed = _agreed_error(reports)
    if error is not None and type(error) is type(agreed) and str(error) == str(agreed):
        raise error
    raise agreed from error


# --- host-side phases: a gloo side group with its own timeout ------------------------------------
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


def error_line(exc: BaseException) -> str:
    """The one-line ``"Type: message"`` form a ``ControlGroup`` agreement carries."""
    return f"{type(exc).__name__}: {exc}"


# --- inside a step: the first failure, recorded in the store and watched by every rank ---------------

def _tcp_client(store: dist.Store, timeout: timedelta) -> dist.Store | None:
    """A second connection to the job's TCPStore (a blocking wait must not hold the main thread's)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False, timeout=timeout)
    return None


class FailureChannel:
    """The first in-step failure of the world, recorded in the c10d store and watched by every rank.

    Build it on every rank (``name`` the same everywhere, unique per channel in the job). ``post``
    records this rank's failure (unless another came first) and returns the agreed message;
    ``failure`` returns the recorded message, waiting up to ``wait`` seconds for one to appear.
    """

    def __init__(self, name: str = "executor", *, ack_timeout: float = 5.0) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.ack_timeout = ack_timeout
        # torchrun's store outlives a restarted attempt: key the record by the attempt too.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._key = f"flexsp/failure/{attempt}/{name}"
        self._ack = f"{self._key}/ack"
        default = dist.distributed_c10d._get_default_store()
        # Separate connections for this thread and the watcher; the same store if it is not TCP.
        self._store = _tcp_client(default, timedelta(seconds=30)) or default
        watch_store = _tcp_client(default, timedelta(seconds=30)) or default
        self._nccl = dist.get_backend() == "nccl"
        self._record: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(watch_store,), daemon=True,
                                        name=f"flexsp-failure-watch-{self.rank}")
        self._thread.start()

    @property
    def record(self) -> str | None:
        with self._lock:
            return self._record

    def _set(self, message: str) -> None:
        with self._lock:
            if self._record is None:
                self._record = message

    def _watch(self, store: dist.Store) -> None:
        while not self._stop.is_set():
            try:
                if not store.check([self._key]):   # non-blocking: one small request per poll
                    self._stop.wait(_POLL_SECONDS)
                    continue
            except Exception:
                self._stop.wait(_POLL_SECONDS)     # the store is unreachable for now: never spin
                continue
            try:
                message = store.get(self._key).decode()
                store.add(self._ack, 1)
            except Exception:
                return   # the store is gone (its host exited): nothing more to learn
            self._set(message)
            if self._nccl:   # unblock this rank's pending NCCL collectives (gloo has no abort)
                try:
                    dist.distributed_c10d._abort_process_group()
                except Exception:
                    pass
            return

    def post(self, exc: BaseException, where: str) -> str:
        """Record ``exc`` as the world's failure (first one wins), wait briefly for the other ranks to
        see it, and return the agreed message."""
        mine = f"rank {self.rank} failed {where}: {type(exc).__name__}: {exc}"
        try:
            self._store.compare_set(self._key, "", mine)
            agreed = self._store.get(self._key).decode()
        except Exception:
            agreed = self.record or mine
        self._set(agreed)
        deadline = time.monotonic() + self.ack_timeout
        while time.monotonic() < deadline:   # peers read it before this process may exit (it may host the store)
            try:
                if self._store.add(self._ack, 0) >= self.world_size:
                    break
            except Exception:
                break
            time.sleep(0.05)
        return agreed

    def failure(self, wait: float = 0.0) -> str | None:
        """The recorded failure, if any rank posted one (waiting up to ``wait`` seconds for it)."""
        deadline = time.monotonic() + wait
        while True:
            if self.record is not None:
                return self.record
            try:
                if self._store.check([self._key]):
                    self._set(self._store.get(self._key).decode())
                    continue
            except Exception:
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the watcher thread (and wait for it, so no thread outlives the training loop)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
