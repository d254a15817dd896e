"""Plan future global batches in a background thread while the current step trains.

The paper's solver takes seconds per batch; hidden behind the previous step's compute it costs
nothing. ``AsyncPlanner`` solves batches in order, at most ``lookahead`` ahead of the batch the loop
last took (a semaphore holds the bound, so memory and wasted work stay bounded after a stop). A
solver exception is captured and handed to the loop as a result, never lost in the thread. If the
loop has waited ``fallback_after`` seconds, the batch being solved is planned at once with
``fallback`` (the greedy strategy) and the late result is discarded.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..plan import Plan
from .batching import GlobalBatch
from .errors import LoaderError

Solver = Callable[[np.ndarray], Plan]
_POLL = 0.05   # seconds between checks for a stop request or a dead thread


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
    solve_seconds: float = 0.0      # solver time of those plans (the background thread's work)
    wait_seconds: float = 0.0       # time the loop spent blocked waiting for a plan
    max_wait: float = 0.0
    last_wait: float = 0.0
    fallbacks: int = 0
    max_ahead: int = 0              # most solves ever started beyond the batch the loop last took


class AsyncPlanner:
    """Solves ``batches`` with ``solve(lengths_of_batch)``; ``next()`` returns them in order.

    ``lookahead=0`` solves synchronously inside ``next()`` (no thread). Call ``close()`` when done.
    """

    def __init__(self, batches: Iterator[GlobalBatch], lengths: np.ndarray, solve: Solver, *,
                 lookahead: int = 2, fallback: Solver | None = None, fallback_after: float | None = None) -> None:
        self._batches, self._lengths, self._solve = batches, lengths, solve
        self.lookahead, self._fallback, self._fallback_after = lookahead, fallback, fallback_after
        self.stats = PlannerStats()
        self._results: queue.Queue[PlannedBatch] = queue.Queue()   # bounded by the permits, never blocks
        self._permits = threading.Semaphore(lookahead)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._current: GlobalBatch | None = None       # the batch the thread is solving now
        self._abandoned: set[tuple[int, int]] = set()  # batches taken by the fallback while solving
        self._started = self._taken = 0
        self._thread: threading.Thread | None = None
        if lookahead > 0:
            self._thread = threading.Thread(target=self._work, name="flexsp-planner", daemon=True)
            self._thread.start()

    # --- the background thread -------------------------------------------------------------------
    def _work(self) -> None:
        try:
            for batch in self._batches:
                while not self._permits.acquire(timeout=_POLL):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                with self._lock:
                    self._current = batch
                    self._started += 1
                    self.stats.max_ahead = max(self.stats.max_ahead, self._started - self._taken)
                result = self._solve_one(batch, self._solve)
                with self._lock:
                    self._current = None
                    if batch.key in self._abandoned:
                        self._abandoned.discard(batch.key)
                        continue
                    self._results.put(result)
                if result.error is not None:
                    return   # the loop will raise; solving further batches would be wasted
        except BaseException as exc:   # batching itself failed (e.g. a too-long sequence)
            self._results.put(PlannedBatch(None, error=f"{type(exc).__name__}: {exc}", exception=exc))

    def _solve_one(self, batch: GlobalBatch, solve: Solver, fallback: bool = False) -> PlannedBatch:
        started = time.perf_counter()
        lengths = self._lengths[list(batch.indices)]
        try:
            plan = solve(lengths)
            _check(plan, lengths)
        except Exception as exc:
            return PlannedBatch(batch, error=f"{type(exc).__name__}: {exc}", exception=exc,
                                solve_seconds=time.perf_counter() - started, fallback=fallback)
        return PlannedBatch(batch, plan=plan, solve_seconds=time.perf_counter() - started, fallback=fallback)

    # --- the training loop's side ----------------------------------------------------------------
    def next(self) -> PlannedBatch:
        """The next batch's plan (or error), waiting only if the solver has not finished it yet."""
        started = time.perf_counter()
        if self._thread is None:
            try:
                batch = next(self._batches)
            except Exception as exc:
                result = PlannedBatch(None, error=f"{type(exc).__name__}: {exc}", exception=exc)
            else:
                result = self._solve_one(batch, self._solve)
            return self._account(result, started)
        while True:
            try:
                result = self._results.get(timeout=_POLL)
                break
            except queue.Empty:
                pass
            if not self._thread.is_alive() and self._results.empty():
                raise LoaderError("the planner thread has stopped (closed, or the batch iterator ended)")
            waited = time.perf_counter() - started
            if self._fallback is not None and self._fallback_after is not None and waited >= self._fallback_after:
                with self._lock:
                    late = self._current
                    if late is not None and late.key in self._abandoned:
                        late = None   # already handed out by the fallback; wait for the thread's next batch
                    if late is not None:
                        self._abandoned.add(late.key)
                if late is not None:
                    result = self._solve_one(late, self._fallback, fallback=True)
                    self.stats.fallbacks += 1
                    break
        with self._lock:
            self._taken += 1
        self._permits.release()
        return self._account(result, started)

    def _account(self, result: PlannedBatch, started: float) -> PlannedBatch:
        wait = time.perf_counter() - started
        s = self.stats
        s.solved += result.plan is not None
        s.solve_seconds += result.solve_seconds
        s.last_wait, s.wait_seconds, s.max_wait = wait, s.wait_seconds + wait, max(s.max_wait, wait)
        return result

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread; a solve already running finishes in the background (the thread is a daemon)."""
        self._stop.set()
        self._permits.release()
        if self._thread is not None:
            self._thread.join(timeout)


def _check(plan: Plan, lengths: np.ndarray) -> None:
    """A custom solver's plan must cover this batch exactly once (PlanError otherwise)."""
    if not isinstance(plan, Plan):
        raise LoaderError(f"the planner returned a {type(plan).__name__}, not a flexsp.Plan")
    plan.validate(lengths=lengths)
