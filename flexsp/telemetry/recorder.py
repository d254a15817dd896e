"""``StepRecorder``: this rank's timings of every step, taken at the executor's probe points.

On a GPU every point records a CUDA event on the current stream (no host sync); the events are
read on the telemetry thread after the step. On a CPU the points are ``perf_counter`` reads at
places where the step is already synchronous, plus the main thread's CPU time when torch runs one
intra-op thread (then a collective's wait, a blocked thread, costs no CPU time and the difference
is idle time). The recorder also times itself (``probe_seconds``: CPU time its hooks took on the training
thread, so preemptions on a busy machine do not count) so the overhead is a measured figure.
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable

import torch

from flexsp.plan.types import Group, Plan
from flexsp.runtime.probe import StepProbe


class PendingStep:
    """One step of this rank, measured; ``rank_record()`` turns it into plain numbers (reads CUDA events)."""

    def __init__(self, plan: Plan, lengths: list[int], meta: dict[str, Any], rank: dict[str, Any],
                 events: list | None) -> None:
        self.plan, self.lengths, self.meta, self._rank, self._events = plan, lengths, meta, rank, events

    def rank_record(self) -> dict[str, Any]:
        if self._events is None:
            return self._rank
        checked, marks, end = self._events
        end.synchronize()   # on the telemetry thread: the training thread never waits for it
        at = lambda ev: checked.elapsed_time(ev) / 1e3   # noqa: E731
        rank = dict(self._rank)
        rank["micro_batches"] = [dict(mb, start=at(b), forward=at(f), end=at(e))
                                 for mb, (b, f, e) in zip(rank["micro_batches"], marks)]
        run = at(end)
        rank["seconds"] = rank["check_seconds"] + run
        rank["tail_seconds"] = run - (rank["micro_batches"][-1]["end"] if rank["micro_batches"] else 0.0)
        rank["idle_seconds"] = sum(mb["end"] - mb["start"] for mb in rank["micro_batches"] if mb["group"] is None)
        return rank


class StepRecorder(StepProbe):
    """Measures each step of one ``StepExecutor`` (pass it as ``probe=``) and hands it to ``sink``."""

    def __init__(self, sink: Callable[[PendingStep], None], *, rank: int = 0, device: torch.device | None = None,
                 on_begin: Callable[[], None] | None = None) -> None:
        self.sink, self.rank, self.on_begin = sink, rank, on_begin
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.enabled = True
        self._plan: Plan | None = None

    # --- probe points (training thread) ---------------------------------------------------------
    def step_begin(self, plan: Plan, source: Any) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self.on_begin is not None:
            self.on_begin()
        self._plan = plan if self.enabled else None
        if self._plan is None:
            return
        self._source, self._begin, self._probe = source, now, 0.0
        self._mbs: list[dict[str, Any]] = []
        self._marks: list[list] = []
        self._busy = not self.cuda and torch.get_num_threads() == 1
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._probe += time.thread_time() - cpu

    def checked(self) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        self._checked = now
        if self.cuda:
            self._checked_event = _event()
        self._probe += time.thread_time() - cpu

    def micro_batch_begin(self, index: int, group: Group | None, real_tokens: int) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        j = None
        if group is not None:
            j = next(i for i, g in enumerate(self._plan.micro_batches[index].groups) if g.ranks == group.ranks)
        self._mbs.append({"start": now - self._checked, "forward": None, "end": None, "group": j,
                          "tokens": int(real_tokens), "busy": time.thread_time() if self._busy else None})
        if self.cuda:
            self._marks.append([_event()])
        self._probe += time.thread_time() - cpu

    def forward_end(self, index: int) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        self._mbs[-1]["forward"] = now - self._checked
        if self.cuda:
            self._marks[-1].append(_event())
        self._probe += time.thread_time() - cpu

    def micro_batch_end(self, index: int) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        mb = self._mbs[-1]
        mb["end"] = now - self._checked
        if self._busy:
            mb["busy"] = time.thread_time() - mb["busy"]
        if self.cuda:
            self._marks[-1].append(_event())
        self._probe += time.thread_time() - cpu

    def step_end(self, result: Any) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        source, plan = self._source, self._plan
        self._plan = None
        loader_step = hasattr(source, "plan_wait")   # the loader's Step, or run_plan's list of tensors
        lengths = [int(n) for n in source.lengths] if loader_step else [int(t.numel()) for t in source]
        meta = {k: getattr(source, k) if loader_step else None for k in ("step", "epoch", "index")}
        meta["fallback"] = bool(source.fallback) if loader_step else False
        if self.cuda:
            memory, meta["memory_kind"] = int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
        else:   # the process's peak resident set since it started (kilobytes on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            memory, meta["memory_kind"] = int(rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"
        mbs = self._mbs
        idle = sum(mb["end"] - mb["start"] for mb in mbs if mb["group"] is None)
        if self._busy:   # waiting inside collectives of this rank's own micro-batches
            idle += sum(max(0.0, mb["end"] - mb["start"] - mb["busy"]) for mb in mbs if mb["group"] is not None)
        rank = {"rank": self.rank, "seconds": now - self._begin, "check_seconds": self._checked - self._begin,
                "tail_seconds": now - self._checked - (mbs[-1]["end"] if mbs else 0.0),
                "plan_wait": float(getattr(source, "plan_wait", 0.0)),
                "load_seconds": float(getattr(source, "load_seconds", 0.0)), "idle_seconds": idle,
                "peak_memory_bytes": memory, "probe_seconds": 0.0, "micro_batches": mbs}
        events = [self._checked_event, self._marks, _event()] if self.cuda else None
        rank["probe_seconds"] = self._probe + time.thread_time() - cpu
        self.sink(PendingStep(plan, lengths, meta, rank, events))


def _event():
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
