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
  A rank that dies without a word (SIGKILL, the OOM killer) is named by its silence: every rank's
  watcher beats a counter in the store, and a survivor whose collective broke first looks for ranks
  whose beat stopped before it posts, so it blames the dead rank rather than itself. Records are
  signed (HMAC-SHA256) with a secret rank 0 draws and broadcasts over the process group at start-up:
  a record from anything else that can reach the store (forged, malformed, not UTF-8) is logged and
  ignored, and the watcher keeps watching.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from flexsp.errors import FlexSPError

_POLL_SECONDS = 0.5   # how often each rank's watcher asks the store for a failure record (and beats)
SILENCE_SECONDS = 3.0   # a rank whose heartbeat did not move for this long is taken for dead
_MAX_RECORD = 1 << 16
_log = logging.getLogger("flexsp.failures")
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


def runs_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether CUDA tensors on ``group`` go through NCCL: backend ``"nccl"``, a device map naming it (``"cpu:gloo,
    cuda:nccl"``), or none named (``init_process_group()``: torch picks NCCL for CUDA tensors) on a CUDA torch."""
    name = str(dist.get_backend(group))
    return "nccl" in name or (name == "undefined" and torch.cuda.is_available())


def flag_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a world collective must live: the current GPU under NCCL alone, else the CPU (a
    world with a CPU backend beside NCCL takes CPU tensors)."""
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
              error: Callable[[str], Exception] = FlexSPError, count: int = 0) -> int:
        """Raise ``error`` with one message on every rank if any rank passed a ``failure`` ("Type: msg");
        otherwise return ``count`` summed over the ranks (a per-step total riding on the same collective).

        One all-reduce of two ints when all went well; the messages are gathered only after a failure.
        """
        if self.distributed:
            t = torch.tensor([0 if failure is None else 1, int(count)], dtype=torch.int64)
            self.call(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group), what, error)
            failed, total = bool(t[0].item()), int(t[1].item())
        else:
            failed, total = failure is not None, int(count)
        if not failed:
            return total
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
            try:
                dist.destroy_process_group(self.group)
            except ValueError:
                pass   # already gone: the failure watcher aborted every group after an NCCL failure
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


def _agree_secret() -> bytes:
    """32 random bytes drawn by rank 0 and broadcast over the world (collective): the job's key for
    failure records. It travels over the process group's own connections, never through the store."""
    t = torch.zeros(32, dtype=torch.uint8)
    if dist.get_rank() == 0:
        t = torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8).clone()
    t = t.to(flag_device())
    dist.broadcast(t, src=0)
    return bytes(t.cpu().tolist())


class _Watcher(threading.Thread):
    """A ``FailureChannel``'s watcher thread; ``stop_watchers`` finds live ones through
    ``threading.enumerate()``, so no registry of channels is kept."""

    def __init__(self, target: Callable[..., None], args: tuple, stop: threading.Event, name: str) -> None:
        super().__init__(target=target, args=args, daemon=True, name=name)
        self.stop_event = stop

    def stop(self, timeout: float) -> None:
        self.stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)


def stop_watchers(timeout: float = 2.0) -> int:
    """Stop every failure watcher thread still running in this process and wait for each (at most
    ``timeout`` seconds apiece); returns how many there were. The runtime's teardown at exit calls it
    before it destroys process groups: a daemon thread caught inside a store call while the interpreter
    shuts down aborts the process (``terminate called without an active exception``)."""
    watchers = [t for t in threading.enumerate() if isinstance(t, _Watcher) and t.is_alive()]
    for t in watchers:
        t.stop(timeout)
    return len(watchers)


class FailureChannel:
    """The first in-step failure of the world, recorded in the c10d store and watched by every rank.

    Build it on every rank at the same point (``name`` the same everywhere, unique per channel in the
    job; construction broadcasts the job's record secret). ``post`` records this rank's failure (unless
    another came first) and returns the agreed message; ``failure`` returns the recorded message,
    waiting up to ``wait`` seconds for one to appear. ``close()`` (or ``with FailureChannel(...)``)
    stops the watcher thread; one left running is stopped by the pool's teardown at exit
    (``flexsp.runtime.pool``).
    """

    def __init__(self, name: str = "executor", *, ack_timeout: float = 5.0,
                 silence: float = SILENCE_SECONDS) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.ack_timeout, self.silence = ack_timeout, silence
        # torchrun's store outlives a restarted attempt: key the record by the attempt too.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._key = f"flexsp/failure/{attempt}/{name}"
        self._ack = f"{self._key}/ack"
        self._beat = f"{self._key}/alive"
        self._secret = _agree_secret()
        default = dist.distributed_c10d._get_default_store()
        # Separate connections for this thread and the watcher; the same store if it is not TCP.
        self._store = _tcp_client(default, timedelta(seconds=30)) or default
        watch_store = _tcp_client(default, timedelta(seconds=30)) or default
        self._nccl = runs_nccl()
        self._record: str | None = None
        self._ignored: set[bytes] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = _Watcher(self._watch, (watch_store,), self._stop, f"flexsp-failure-watch-{self.rank}")
        self._thread.start()

    @property
    def record(self) -> str | None:
        with self._lock:
            return self._record

    def _set(self, message: str) -> None:
        with self._lock:
            if self._record is None:
                self._record = message

    # --- signed records ---------------------------------------------------------------------------
    def _mac(self, rank: int, message: str) -> str:
        return hmac.new(self._secret, f"{self._key}\n{rank}\n{message}".encode(), hashlib.sha256).hexdigest()

    def _encode(self, message: str) -> str:
        return json.dumps({"rank": self.rank, "message": message, "mac": self._mac(self.rank, message)})

    def _decode(self, raw: bytes | str) -> str | None:
        """The message of a record this job wrote, or None (logged once) for anything else."""
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        try:
            if len(raw) > _MAX_RECORD:
                raise ValueError(f"{len(raw)} bytes")
            data = json.loads(raw.decode("utf-8"))
            rank, message, mac = data["rank"], data["message"], data["mac"]
            if not (isinstance(rank, int) and isinstance(message, str) and isinstance(mac, str)):
                raise ValueError("wrong field types")
            if not hmac.compare_digest(self._mac(rank, message), mac):
                raise ValueError("not signed with this job's secret")
            return message
        except Exception as exc:   # malformed, not UTF-8, foreign: whatever it is, it is not ours
            if raw not in self._ignored and len(self._ignored) < 100:
                self._ignored.add(raw)
                _log.warning("rank %d ignored a failure record under %s that is not from this job (%s: %s): %r",
                             self.rank, self._key, type(exc).__name__, exc, raw[:80])
            return None

    # --- the watcher ------------------------------------------------------------------------------
    def _watch(self, store: dist.Store) -> None:
        """Beat, and look for a record; after one is found keep beating until closed (a survivor that
        stopped beating would be taken for dead by the others)."""
        beat, found, failures = f"{self._beat}/{self.rank}", False, 0
        while not self._stop.is_set():
            try:
                store.add(beat, 1)
                if not found and store.check([self._key]):   # non-blocking: one small request per poll
                    message = self._decode(store.get(self._key))
                    if message is not None:
                        found = True
                        store.add(self._ack, 1)
                        self._set(message)
                        if self._nccl:   # unblock this rank's pending NCCL collectives (gloo has no abort)
                            try:
                                dist.distributed_c10d._abort_process_group()
                            except Exception:
                                pass
                failures = 0
            except Exception:
                failures += 1                      # the store is unreachable for now: never spin
                if failures * _POLL_SECONDS > 60:
                    return                         # its host is gone: nothing more to learn
            self._stop.wait(_POLL_SECONDS)

    def silent_ranks(self, window: float | None = None) -> list[int]:
        """Ranks (other than this one) whose heartbeat did not move in ``window`` seconds."""
        window = self.silence if window is None else window
        keys = [f"{self._beat}/{r}" for r in range(self.world_size)]
        try:
            before = [self._store.add(k, 0) for k in keys]
            time.sleep(window)
            after = [self._store.add(k, 0) for k in keys]
        except Exception:
            return []
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def post(self, exc: BaseException, where: str) -> str:
        """Record ``exc`` as the world's failure (first one wins), wait briefly for the other ranks to
        see it, and return the agreed message. A communication error (``RuntimeError``: a peer's
        socket closed, a timeout) first looks for a rank whose heartbeat stopped, and blames it."""
        mine = f"rank {self.rank} failed {where}: {type(exc).__name__}: {exc}"
        if isinstance(exc, RuntimeError) and self.failure() is None:
            dead = self.silent_ranks()
            if dead:
                line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                mine = (f"rank {dead[0]} died {where} (its heartbeat stopped"
                        f"{f'; so did ranks {dead[1:]}' if dead[1:] else ''}); rank {self.rank} saw "
                        f"{type(exc).__name__}: {line}")
        record = self._encode(mine)
        agreed = None
        try:
            current = self._store.compare_set(self._key, "", record)
            agreed = self._decode(current)
            if agreed is None:   # someone squats the key with a record not from this job: replace it
                agreed = self._decode(self._store.compare_set(self._key, current, record))
        except Exception:
            pass
        agreed = agreed or self.record or mine
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
                    message = self._decode(self._store.get(self._key))
                    if message is not None:
                        self._set(message)
                        continue
            except Exception:
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the watcher thread (and wait for it, so no thread outlives the training loop); idempotent."""
        self._thread.stop(timeout)

    def __enter__(self) -> "FailureChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
