"""Plan future global batches in a separate process while the current step trains.

The paper's solver takes seconds per batch; hidden behind the previous step's compute it costs
nothing, but only if it does not compete with the training loop for the interpreter: a solver
thread holds the GIL for most of its run (a CPU-bound Python loop slowed to about 0.67x). So the
solver runs in a **spawned** process (``mode="process"``: a fresh interpreter, no fork of a process
holding CUDA or torch state). The loop's side sends each batch's lengths and receives the plan as a
few flat integer arrays (``pack_plan``), so its own work per step is a pipe read and a rebuild. A
solver that cannot be pickled (a lambda, a closure) runs in a thread instead (``mode="auto"``).

``AsyncPlanner`` keeps at most ``lookahead`` batches submitted beyond the one the loop last took,
so memory and wasted work stay bounded after a stop. A solver exception comes back as a result,
never lost in the worker. If the loop has waited ``fallback_after`` seconds (the loader always sets a
deadline: ``LoaderConfig.planner_deadline``), the batch being solved is planned at
once in the loop's process with ``fallback`` (the greedy strategy), with a warning, and the late
result is discarded. A worker that missed its deadline is treated like a dead one: a planner process
that stopped (SIGSTOP), wedged or died is replaced by a fresh one (its in-flight batches resubmitted),
so one stall costs one deadline, not one per step; up to ``max_restarts`` times in a row, then ``PlannerError``.
The deadline counts from the later of the loop's request and the worker being up (a fresh worker
gets one deadline to start). A closed pipe is a dead worker, never a raw ``EOFError``/``BrokenPipeError``.
No batch waits for the first worker's start (an interpreter and its imports, about half a CPU-second,
as long as many small steps): the first batch is planned in the loop's process and only then is the
worker spawned (on a busy host its start then does not compete with the plan the first step waits for);
until it is up, the loop's process plans each batch it asks for itself and the worker is told to skip
it (for at most one deadline from its spawn: a worker that never comes up is then replaced like a
stalled one). Every plan is the same solver's on the same lengths, wherever it was made.
"""
from __future__ import annotations

import collections
import functools
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from flexsp.data.batching import GlobalBatch
from flexsp.data.errors import LoaderError, PlannerError
from flexsp.plan.config import PlanConfig
from flexsp.plan.types import Group, MicroBatch, PlacedGroups, Plan

if TYPE_CHECKING:
    from flexsp.plan.cluster import Cluster
    from flexsp.plan.cost import CostModel

Solver = Callable[[np.ndarray], Plan]
MODES = ("auto", "process", "thread")
_POLL = 0.05   # seconds between checks for a stop request or a dead worker
MAX_RESTARTS = 3
READY = (None, None, None, None, 0.0)   # the worker's first message: it is up and reading tasks


@dataclass(frozen=True)
class PlannedBatch:
    """A batch and its plan, or the error that stopped planning (``batch`` is None if batching failed)."""

    batch: GlobalBatch | None
    plan: Plan | None = None
    error: str | None = None        # "Type: message"
    exception: BaseException | None = None
    solve_seconds: float = 0.0
    fallback: bool = False


@dataclass
class PlannerStats:
    solved: int = 0                 # plans handed to the loop
    solve_seconds: float = 0.0      # solver time of those plans (the worker's work)
    wait_seconds: float = 0.0       # time the loop spent blocked waiting for a plan
    max_wait: float = 0.0
    last_wait: float = 0.0
    fallbacks: int = 0
    max_ahead: int = 0              # most solves ever started beyond the batch the loop last took
    restarts: int = 0               # planner workers replaced after one died or missed its deadline


@dataclass(frozen=True)
class PlanBatch:
    """``plan_batch`` with fixed settings, as a picklable solver the planner process can run."""

    cost: "CostModel"
    cluster: "Cluster"
    config: PlanConfig = PlanConfig()

    def __call__(self, lengths: np.ndarray) -> Plan:
        from flexsp.plan.planner import plan_batch  # the solver is only imported where plans are made
        return plan_batch(lengths, self.cost, self.cluster, config=self.config)

    def warm(self) -> None:
        """Pay the solver's first-call costs now (``warm_solver``: once a process, whatever the cost model).
        The planner process does this before it says it is up; the loader's ``start()`` on the thread that
        calls it, so the first plan on the loader thread, which shares the GIL with a training thread still
        setting up, is only the plan (16 -> 5 ms here)."""
        warm_solver()


@functools.cache
def warm_solver() -> None:
    """The solver's first-call costs, paid once a process: its imports and the lazy ones inside numpy
    (``np.unique`` imports ``numpy.ma``, 13 ms), on a two-GPU plan of a made-up cost (the costs are the same
    whatever the model). The HF Trainer calls it at construction, because it takes its first step a few
    milliseconds after its loader starts: 15 ms of warm-up there was most of the first step's wait, and a
    second warm-up in ``start()`` (a whole tiny plan, 3.5-5 ms) delayed the first plan as much again."""
    from flexsp.plan.cluster import Cluster
    from flexsp.plan.planner import plan_batch
    from flexsp.plan.token_budget import token_budget_cost
    try:
        plan_batch(np.ones(2, dtype=np.int64), token_budget_cost(1, 8, 2, 64), Cluster(2, 2))
    except Exception:
        pass   # a warm-up only: whatever is wrong is raised by the first real batch's plan


# --- compact plans ----------------------------------------------------------------------------------

def pack_plan(plan: Plan) -> dict[str, Any]:
    """A plan as a few flat integer arrays (groups per micro-batch, rank blocks, seq ids with
    counts) in the narrowest integer types: about half the bytes of the pickled ``Plan`` or its JSON, and
    ``unpack_plan`` rebuilds it without parsing. Groups on contiguous ranks (every planner strategy)
    store only their first rank."""
    if plan.micro_batches and all(isinstance(mb.groups, PlacedGroups) for mb in plan.micro_batches):
        return _pack_columns(plan)
    groups = [g for mb in plan.micro_batches for g in mb.groups]
    contiguous = all(g.ranks == tuple(range(g.ranks[0], g.ranks[0] + len(g.ranks))) for g in groups if g.ranks)
    ranks = ([g.ranks[0] if g.ranks else 0 for g in groups] if contiguous
             else [r for g in groups for r in g.ranks])
    return {
        "num_gpus": plan.num_gpus, "predicted_time": plan.predicted_time, "strategy": plan.strategy,
        "gpus_per_node": plan.gpus_per_node, "solve_time": plan.solve_time, "meta": dict(plan.meta),
        "groups_per_mb": _small([len(mb.groups) for mb in plan.micro_batches]),
        "ring": _small([g.ring for g in groups]),
        "rank_counts": _small([len(g.ranks) for g in groups]),
        "ranks": _small(ranks),
        "contiguous": contiguous,
        "seq_counts": _small([len(g.seq_ids) for g in groups]),
        "seq_ids": _small([s for g in groups for s in g.seq_ids]),
    }


def _pack_columns(plan: Plan) -> dict[str, Any]:
    """``pack_plan`` of a plan whose groups are ``PlacedGroups`` (what ``plan_batch`` makes): the columns
    joined, no group object built."""
    columns = [mb.groups for mb in plan.micro_batches]
    joined = {name: np.concatenate([getattr(c, name) for c in columns]) for name in ("first_ranks", "degrees", "rings", "ids", "sizes")}
    return {
        "num_gpus": plan.num_gpus, "predicted_time": plan.predicted_time, "strategy": plan.strategy,
        "gpus_per_node": plan.gpus_per_node, "solve_time": plan.solve_time, "meta": dict(plan.meta),
        "groups_per_mb": _small([len(c) for c in columns]), "ring": _small(joined["rings"]),
        "rank_counts": _small(joined["degrees"]), "ranks": _small(joined["first_ranks"]), "contiguous": True,
        "seq_counts": _small(joined["sizes"]), "seq_ids": _small(joined["ids"]),
    }


def _small(values: list[int] | np.ndarray) -> np.ndarray:
    """Non-negative integers in the narrowest unsigned type that holds them."""
    top = (int(values.max()) if len(values) else 0) if isinstance(values, np.ndarray) else max(values, default=0)
    return np.asarray(values, dtype=next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64)
                                         if top <= np.iinfo(t).max))


def unpack_plan(packed: dict[str, Any]) -> Plan:
    counts, seq_counts = packed["rank_counts"], packed["seq_counts"]
    bounds = [0, *np.cumsum(packed["groups_per_mb"], dtype=np.int64).tolist()]
    if packed["contiguous"]:     # as columns (``PlacedGroups``): groups built only if a caller walks them
        seq_bounds = np.concatenate([[0], np.cumsum(seq_counts, dtype=np.int64)])
        micro_batches = tuple(
            MicroBatch(PlacedGroups(packed["ranks"][a:b], counts[a:b], packed["ring"][a:b],
                                    packed["seq_ids"][seq_bounds[a]:seq_bounds[b]], seq_counts[a:b]))
            for a, b in zip(bounds[:-1], bounds[1:]))
    else:
        ranks = np.split(packed["ranks"], np.cumsum(counts, dtype=np.int64)[:-1]) if len(counts) else []
        seqs = np.split(packed["seq_ids"], np.cumsum(seq_counts, dtype=np.int64)[:-1]) if len(counts) else []
        groups = [Group(ranks=tuple(int(r) for r in rk), seq_ids=tuple(s.tolist()), ring=int(ring))
                  for rk, s, ring in zip(ranks, seqs, packed["ring"].tolist())]
        micro_batches = tuple(MicroBatch(tuple(groups[a:b])) for a, b in zip(bounds[:-1], bounds[1:]))
    return Plan(num_gpus=packed["num_gpus"], micro_batches=micro_batches, predicted_time=packed["predicted_time"],
                strategy=packed["strategy"], gpus_per_node=packed["gpus_per_node"],
                solve_time=packed["solve_time"], meta=packed["meta"])


def _solve(solve: Solver, lengths: np.ndarray) -> tuple[Plan | None, str | None, BaseException | None, float]:
    started = time.perf_counter()
    try:
        plan = solve(lengths)
        _check(plan, lengths)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}", exc, time.perf_counter() - started
    return plan, None, None, time.perf_counter() - started


def _serve(tasks, results, solve: Solver) -> None:
    """The planner process: solve ``(key, lengths)`` tasks in order, send back packed plans or errors.

    A reader thread drains the task pipe so the loop's sends never wait on a running solve.
    """
    inbox: queue.Queue = queue.Queue()
    skip: set = set()   # batches the loop planned itself (``(key, None)``): not solved here

    def read() -> None:
        while True:
            try:
                item = tasks.recv()
            except (EOFError, OSError):
                item = None
            if item is not None and item[0] is not None and item[1] is None:
                skip.add(item[0])
                continue
            inbox.put(item)
            if item is None:
                return

    threading.Thread(target=read, name="flexsp-planner-inbox", daemon=True).start()
    warm = getattr(solve, "warm", None)
    if callable(warm):
        warm()   # imports done before "up": a deadline then measures solves, not imports
    try:
        results.send(READY)   # up: the loop's deadlines count from here, not from the interpreter's start
    except (BrokenPipeError, OSError):
        return
    while (item := inbox.get()) is not None:
        key, lengths = item
        if key is None:   # a new solver (``AsyncPlanner.set_solver``) for the batches after this point
            solve = lengths
            continue
        if key in skip:
            skip.discard(key)
            continue
        plan, error, exc, seconds = _solve(solve, lengths)
        try:
            pickle.dumps(exc)
        except Exception:
            exc = None   # the message still says what went wrong
        try:
            results.send((key, None if plan is None else pack_plan(plan), error, exc, seconds))
        except (BrokenPipeError, OSError):
            return


def picklable(obj: object) -> bool:
    """Whether the spawned planner process can load ``obj``: it pickles, and names nothing of ``__main__`` (the
    script being run is not the worker's main module: a function defined there pickles, then fails to load)."""
    try:
        data = pickle.dumps(obj)
    except Exception:
        return False
    return b"__main__" not in data


class AsyncPlanner:
    """Solves ``batches`` with ``solve(lengths_of_batch)``; ``next()`` returns them in order.

    ``mode``: "process" (a spawned worker; ``solve`` must pickle), "thread", or "auto" (process when
    ``solve`` pickles). ``lookahead=0`` solves synchronously inside ``next()``. Call ``close()`` when done.
    """

    def __init__(self, batches: Iterator[GlobalBatch], lengths: np.ndarray, solve: Solver, *,
                 lookahead: int = 2, fallback: Solver | None = None, fallback_after: float | None = None,
                 mode: str = "auto", max_restarts: int = MAX_RESTARTS) -> None:
        if mode not in MODES:
            raise LoaderError(f"planner mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._batches, self._lengths, self._solve = batches, lengths, solve
        self.lookahead, self._fallback, self._fallback_after = lookahead, fallback, fallback_after
        self.max_restarts = max_restarts
        self._in_a_row = 0   # restarts since the worker last answered: a long run's occasional stall is not fatal
        self.stats = PlannerStats()
        self._started = self._taken = 0
        self._closed = False
        if lookahead == 0:
            self.mode = "sync"
        elif mode == "thread" or (mode == "auto" and not picklable(solve)):
            self.mode = "thread"
        else:
            if not picklable(solve):
                raise LoaderError(f"mode='process' needs a solver the planner process can load (a function of an "
                                  f"importable module, not of the script being run, or flexsp.data.PlanBatch), got "
                                  f"{solve!r}; use mode='thread' for this one")
            self.mode = "process"
        self._backend: _ProcessBackend | _ThreadBackend | None = None   # a thread: with the first batch submitted;
        # a process: once the first batch is planned here (_launch)
        self._inflight: collections.deque[GlobalBatch] = collections.deque()   # submitted, not yet taken
        self._abandoned: set[tuple[int, int]] = set()   # taken by the fallback while the worker solved them
        self._ended: PlannedBatch | None = None          # the batch iterator's error, after the in-flight ones
        self._exhausted = False
        self._hold = self.mode == "process"   # the worker is spawned once the first batch is planned here
        self._lock = threading.Lock()   # next() and wait_ready() may come from two threads (loader and caller)
        self._submit()

    # --- submitting ------------------------------------------------------------------------------
    def _submit(self) -> None:
        """Keep ``lookahead`` batches submitted beyond the one the loop last took."""
        while self.mode != "sync" and not self._closed and not self._exhausted and len(self._inflight) < self.lookahead:
            try:
                batch = next(self._batches)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:   # batching itself failed (e.g. a too-long sequence)
                self._exhausted = True
                self._ended = PlannedBatch(None, error=f"{type(exc).__name__}: {exc}", exception=exc)
                return
            self._inflight.append(batch)
            self._started += 1
            self.stats.max_ahead = max(self.stats.max_ahead, self._started - self._taken)
            if self._hold:
                continue   # sent when the worker is spawned (after the first batch: _launch)
            if self._backend is None:
                self._backend = _ProcessBackend(self._solve) if self.mode == "process" else _ThreadBackend(self._solve)
            self._backend.submit(batch.key, self._lengths[list(batch.indices)])

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Wait up to ``timeout`` seconds for the worker to be up (benchmarks and tests that need every
        batch solved by the worker, the first one included); False if it was not."""
        deadline = time.perf_counter() + timeout
        with self._lock:   # the loader's thread may be in next(): one reader of the worker's pipe at a time
            return self._wait_ready(deadline)

    def _launch(self) -> None:
        """Spawn the worker and send it the batches submitted so far."""
        self._hold = False
        if self._closed or not self._inflight:
            return
        self._backend = _ProcessBackend(self._solve)
        self._resubmit()

    def _resubmit(self) -> None:
        """Send every batch submitted and not yet taken to the (fresh) worker."""
        for batch in self._inflight:
            self._backend.submit(batch.key, self._lengths[list(batch.indices)])

    def _wait_ready(self, deadline: float) -> bool:
        if self._hold:
            self._launch()
        while self._backend is not None and self._backend.ready_at is None and time.perf_counter() < deadline:
            self._backend.receive(min(_POLL, max(0.0, deadline - time.perf_counter())))
        return self._backend is None or self._backend.ready_at is not None

    def set_solver(self, solve: Solver, fallback: Solver | None = None) -> None:
        """Solve the batches submitted from now on with ``solve`` (and ``fallback``), e.g. with a refitted
        cost model; the up to ``lookahead`` batches already submitted keep the solver they were sent to."""
        if self.mode == "process" and not picklable(solve):
            raise LoaderError(f"mode='process' needs a picklable solver, got {solve!r}")
        if self._hold:
            self._launch()   # the batches submitted so far go to the worker with the solver they were submitted under
        self._solve = solve
        if fallback is not None:
            self._fallback = fallback
        if self._backend is not None:
            self._backend.submit(None, solve)

    # --- the training loop's side ----------------------------------------------------------------
    def next(self) -> PlannedBatch:
        """The next batch's plan (or error), waiting only if the solver has not finished it yet."""
        started = time.perf_counter()
        with self._lock:
            return self._next(started)

    def _next(self, started: float) -> PlannedBatch:
        if self.mode == "sync":
            try:
                batch = next(self._batches)
            except Exception as exc:
                result = PlannedBatch(None, error=f"{type(exc).__name__}: {exc}", exception=exc)
            else:
                result = self._local(batch, self._solve)
            return self._account(result, started)
        if not self._inflight:
            if self._ended is not None:
                return self._account(self._ended, started)
            raise LoaderError(f"the planner {self.mode} has stopped (closed, or the batch iterator ended)")
        result = None
        if self._hold:   # the first batch: planned here, then the worker is spawned for the rest
            due = self._inflight.popleft()
            result = self._local(due, self._solve)
            self._launch()
        elif self.mode == "process" and self._backend.ready_at is None and self.stats.restarts == 0:
            self._backend.receive(0.0)   # its "up" message, if it came (sent before any plan)
            starting = (self._fallback_after is None
                        or time.perf_counter() - self._backend.started_at < self._fallback_after)
            if self._backend.ready_at is None and self._backend.dead() is None and starting:
                # the first worker is still starting (an interpreter and its imports: as long as many small
                # steps): plan this batch here instead of waiting (a replacement gets its deadline instead);
                # one not up within a deadline of its spawn is waited for below, then replaced like a stalled one
                due = self._inflight.popleft()
                self._abandoned.add(due.key)
                self._backend.submit(due.key, None)   # the worker skips it
                result = self._local(due, self._solve)
        while result is None:
            reply = self._backend.receive(_POLL)
            if reply is not None:
                key, packed, error, exc, seconds = reply
                if key in self._abandoned:
                    self._abandoned.discard(key)   # the fallback already handed this batch out
                    continue
                self._in_a_row = 0   # the worker answers: the restarts before it were stalls, not a broken worker
                batch = self._inflight.popleft()
                if batch.key != key:
                    raise LoaderError(f"the planner returned batch {key} while {batch.key} was due")
                if packed is None:
                    exc = exc if exc is not None else LoaderError(error)
                    result = PlannedBatch(batch, error=error, exception=exc, solve_seconds=seconds)
                else:
                    result = PlannedBatch(batch, plan=unpack_plan(packed), solve_seconds=seconds)
                break
            problem = self._backend.dead()
            if problem:
                self._restart(problem)
                continue
            # the deadline counts from the later of this request and the worker being up (a fresh worker
            # gets one deadline to come up, then one per batch)
            since = max(started, self._backend.ready_at or self._backend.started_at)
            if (self._fallback is not None and self._fallback_after is not None
                    and time.perf_counter() - since >= self._fallback_after):
                late = self._inflight.popleft()
                what = (f"the planner {self.mode} did not answer within {self._fallback_after:g} s for global batch "
                        f"{late.index} of epoch {late.epoch}")
                self._restart(what, warn=False)   # stopped or wedged: replaced like a dead one (or PlannerError)
                result = self._local(late, self._fallback, fallback=True)
                self.stats.fallbacks += 1
                warnings.warn(f"{what}: planned it with the fallback (greedy) instead ({self.stats.fallbacks} so far) "
                              f"and replaced the {self.mode} ({self._in_a_row} in a row, at most "
                              f"{self.max_restarts})", RuntimeWarning, stacklevel=4)
        self._taken += 1
        self._submit()
        return self._account(result, started)

    def _restart(self, problem: str, warn: bool = True) -> None:
        """A dead, stopped or wedged worker: end it, start another and resubmit what it had not answered,
        at most ``max_restarts`` times in a row, without an answer from a worker between them (then
        ``PlannerError``): a days-long run survives its occasional stall, a worker that never answers does
        not. A process is killed; a thread cannot be, so it is abandoned to finish its solve alone (a daemon,
        its answers unread)."""
        if self._in_a_row >= self.max_restarts:
            self._backend.close(0.0)
            raise PlannerError(f"the planner {self.mode} stopped unexpectedly ({problem}) after "
                               f"{self._in_a_row} restart(s) in a row; see its stderr above for why")
        self._in_a_row += 1
        self.stats.restarts += 1
        if warn:
            warnings.warn(f"{problem}; restarting it ({self._in_a_row} in a row, at most {self.max_restarts})",
                          RuntimeWarning, stacklevel=5)
        self._backend.close(0.0)
        self._abandoned.clear()   # a fresh worker never answers the old one's batches
        self._backend = _ProcessBackend(self._solve) if self.mode == "process" else _ThreadBackend(self._solve)
        self._resubmit()

    def _local(self, batch: GlobalBatch, solve: Solver, fallback: bool = False) -> PlannedBatch:
        plan, error, exc, seconds = _solve(solve, self._lengths[list(batch.indices)])
        return PlannedBatch(batch, plan=plan, error=error, exception=exc, solve_seconds=seconds, fallback=fallback)

    def _account(self, result: PlannedBatch, started: float) -> PlannedBatch:
        wait = time.perf_counter() - started
        s = self.stats
        s.solved += result.plan is not None
        s.solve_seconds += result.solve_seconds
        s.last_wait, s.wait_seconds, s.max_wait = wait, s.wait_seconds + wait, max(s.max_wait, wait)
        return result

    def close(self, timeout: float = 1.0) -> None:
        """Stop the worker: a process is asked to stop, then terminated if a solve still runs after
        ``timeout``; a thread finishes its running solve in the background (it is a daemon)."""
        self._closed = True
        if self._backend is not None:
            self._backend.close(timeout)


_WORKER = """
import sys
from multiprocessing.connection import Connection
tasks, results = Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
sys.path[:] = tasks.recv()   # the launching process's import path, so the solver unpickles here too
from flexsp.data.planning import _serve
_serve(tasks, results, tasks.recv())
"""


# the planner is one sequential search: its numpy / BLAS must not spread over the training loop's cores
_ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class _ProcessBackend:
    """A freshly spawned interpreter (``sys.executable``) and two one-way pipes.

    Started with ``subprocess`` rather than ``multiprocessing``: it does not re-import the launching
    script, and it works inside daemonic processes (multiprocessing workers may not have children).
    """

    def __init__(self, solve: Solver) -> None:
        task_read, task_write = os.pipe()
        result_read, result_write = os.pipe()
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _WORKER, str(task_read), str(result_write)],
                                             pass_fds=(task_read, result_write), stdin=subprocess.DEVNULL,
                                             env={**os.environ, **_ONE_THREAD})
        except BaseException:
            for fd in (task_read, task_write, result_read, result_write):
                os.close(fd)
            raise
        os.close(task_read)
        os.close(result_write)
        self.started_at, self.ready_at = time.perf_counter(), None   # ready: its first message arrived
        self._pending: list = []   # tasks submitted before it was up
        self._tasks = Connection(task_write, readable=False)
        self._results = Connection(result_read, writable=False)
        self._closed_pipe = False
        try:
            self._tasks.send(list(sys.path))
            self._tasks.send(solve)
        except (BrokenPipeError, OSError):
            self._closed_pipe = True   # the worker died at once: dead() reports it

    def submit(self, key: tuple[int, int] | None, lengths: np.ndarray | Solver | None) -> None:
        """Send a batch's lengths, (key None) a new solver, or (lengths None) "skip this batch". Until the
        worker is up they are kept here (a worker that is not reading yet would fill the pipe and block the
        loop); "skip" then just drops the batch from them."""
        task = (key, lengths if key is None or lengths is None else np.asarray(lengths, dtype=np.int64))
        if self.ready_at is None:
            if key is not None and lengths is None:
                self._pending = [t for t in self._pending if t[0] != key]
            else:
                self._pending.append(task)
            return
        self._send(task)

    def _send(self, task) -> None:
        try:
            self._tasks.send(task)
        except (BrokenPipeError, OSError):
            pass   # the worker is gone: dead() reports it

    def receive(self, timeout: float):
        if self._closed_pipe:
            time.sleep(min(timeout, _POLL))
            return None
        try:
            reply = self._results.recv() if self._results.poll(timeout) else None
        except (EOFError, OSError, pickle.UnpicklingError):
            self._closed_pipe = True   # the worker is gone (or its last message was cut off)
            return None
        if reply is not None and reply[0] is None:   # READY
            self.ready_at = time.perf_counter()
            pending, self._pending = self._pending, []
            for task in pending:
                self._send(task)
            return None
        return reply

    def dead(self) -> str | None:
        code = self._process.poll()
        if code is None and self._closed_pipe:
            try:
                code = self._process.wait(1.0)
            except subprocess.TimeoutExpired:
                return "the planner process closed its pipe"
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the planner process (pid {self._process.pid}) {how}"

    def close(self, timeout: float) -> None:
        try:
            self._tasks.send(None)
        except (BrokenPipeError, OSError):
            pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()   # a solve is still running (or the worker is stopped): not wanted
            self._process.wait()
        self._tasks.close()
        self._results.close()


class _ThreadBackend:
    """The same protocol on a thread, for solvers that cannot be pickled."""

    def __init__(self, solve: Solver) -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, args=(solve,), name="flexsp-planner", daemon=True)
        self._thread.start()
        self.started_at = self.ready_at = time.perf_counter()

    def _work(self, solve: Solver) -> None:
        while (item := self._tasks.get()) is not None:
            key, lengths = item
            if key is None:
                solve = lengths
                continue
            plan, error, exc, seconds = _solve(solve, lengths)
            self._results.put((key, None if plan is None else pack_plan(plan), error, exc, seconds))

    def submit(self, key: tuple[int, int] | None, lengths: np.ndarray | Solver) -> None:
        self._tasks.put((key, lengths))

    def receive(self, timeout: float):
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def dead(self) -> str | None:
        return None if self._thread.is_alive() else "the planner thread has stopped"

    def close(self, timeout: float) -> None:
        self._tasks.put(None)
        self._thread.join(timeout)


def _check(plan: Plan, lengths: np.ndarray) -> None:
    """A custom solver's plan must cover this batch exactly once (PlanError otherwise)."""
    if not isinstance(plan, Plan):
        raise LoaderError(f"the planner returned a {type(plan).__name__}, not a flexsp.Plan")
    plan.validate(lengths=lengths)
