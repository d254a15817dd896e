"""``StepRecorder``: this rank's timings of every step, taken at the executor's probe points.

On a GPU every point records a CUDA event on the current stream (no host sync); the events are
read on the telemetry thread after the step. On a CPU the points are ``perf_counter`` reads at
places where the step is already synchronous, plus the main thread's CPU time when torch runs one
intra-op thread (then a collective's wait, a blocked thread, costs no CPU time and the difference
is idle time). The recorder also times itself (``probe_seconds``: CPU time its hooks took on the training
thread, so preemptions on a busy machine do not count) so the overhead is a measured figure.

What the training thread pays is kept to reading clocks and recording events: CUDA events come from a
pool the telemetry thread refills after reading them (no event created per mark), the peak memory is
read from the allocator's counters directly (``torch.cuda.max_memory_allocated`` flattens every
allocator statistic in Python first), the one-time CUDA set-up happens when the recorder is built (not
in the first step), and everything derived (group indices, idle time, the rank record) is computed on
the telemetry thread.
"""
from __future__ import annotations

import resource
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from flexsp.plan.types import Group, Plan
from flexsp.runtime.probe import StepProbe


class PendingStep:
    """One step of this rank, measured; ``rank_record()`` turns it into plain numbers (reads CUDA events,
    then hands them back to ``events_pool``), on the telemetry thread."""

    def __init__(self, plan: Plan, lengths: Sequence[int], meta: dict[str, Any], rank: dict[str, Any],
                 events: list | None, events_pool: "EventPool | None" = None) -> None:
        self.plan, self.meta, self._rank, self._events, self._pool = plan, meta, rank, events, events_pool
        self.lengths = [int(n) for n in lengths]

    def rank_record(self) -> dict[str, Any]:
        rank = dict(self._rank)
        mbs = rank["micro_batches"] = [self._micro_batch(mb) for mb in rank["micro_batches"]]
        if self._events is None:
            return rank
        checked, marks, end = self._events
        end.synchronize()   # on the telemetry thread: the training thread never waits for it
        at = lambda ev: checked.elapsed_time(ev) / 1e3   # noqa: E731
        for mb, (b, f, e) in zip(mbs, marks):
            mb.update(start=at(b), forward=at(f), end=at(e))
        run = at(end)
        rank["seconds"] = rank["check_seconds"] + run
        rank["tail_seconds"] = run - (mbs[-1]["end"] if mbs else 0.0)
        rank["idle_seconds"] = sum(mb["end"] - mb["start"] for mb in mbs if mb["group"] is None)
        if self._pool is not None:
            self._pool.give([checked, end, *(ev for trio in marks for ev in trio)])
        return rank

    def _micro_batch(self, mb: dict[str, Any]) -> dict[str, Any]:
        """The micro-batch's figures, with its group's index in the micro-batch (from the ``Group`` the hook kept)."""
        out = {k: v for k, v in mb.items() if k not in ("group_of", "micro_batch")}
        group = mb.get("group_of")
        if group is not None:
            groups = self.plan.micro_batches[mb["micro_batch"]].groups
            out["group"] = next(i for i, g in enumerate(groups) if g.ranks == group.ranks)
        out["tokens"] = int(out["tokens"])
        return out


class EventPool:
    """Timing CUDA events, created ahead and reused: the training thread takes, the telemetry thread gives
    back after reading them (list append/pop are atomic under the GIL)."""

    def __init__(self, warm: int = 0) -> None:
        self._free: list = []
        for _ in range(warm):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()   # the CUDA event is created at its first record: do it now, not inside a step
            self._free.append(ev)
        if self._free:
            self._free[-1].synchronize()

    def take(self):
        try:
            ev = self._free.pop()
        except IndexError:
            ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def give(self, events: list) -> None:
        self._free.extend(events)


class StepRecorder(StepProbe):
    """Measures each step of one ``StepExecutor`` (pass it as ``probe=``) and hands it to ``sink``."""

    def __init__(self, sink: Callable[[PendingStep], None], *, rank: int = 0, device: torch.device | None = None,
                 on_begin: Callable[[], None] | None = None) -> None:
        self.sink, self.rank, self.on_begin = sink, rank, on_begin
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.enabled = True
        self._plan: Plan | None = None
        self._events: EventPool | None = None
        if self.cuda:   # the one-time CUDA set-up, here rather than in the first step
            self._device = torch.device(device)
            self._events = EventPool(warm=32)
            peak_allocated(self._device)

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
            torch.cuda.reset_peak_memory_stats(self._device)
        self._probe += time.thread_time() - cpu

    def checked(self) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        self._checked = now
        if self.cuda:
            self._checked_event = self._events.take()
        self._probe += time.thread_time() - cpu

    def micro_batch_begin(self, index: int, group: Group | None, real_tokens: int) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        # the group's index in the micro-batch is looked up on the telemetry thread (PendingStep)
        self._mbs.append({"start": now - self._checked, "forward": None, "end": None, "group": None,
                          "group_of": group, "micro_batch": index, "tokens": real_tokens,
                          "busy": time.thread_time() if self._busy else None})
        if self.cuda:
            self._marks.append([self._events.take()])
        self._probe += time.thread_time() - cpu

    def forward_end(self, index: int) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        self._mbs[-1]["forward"] = now - self._checked
        if self.cuda:
            self._marks[-1].append(self._events.take())
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
            self._marks[-1].append(self._events.take())
        self._probe += time.thread_time() - cpu

    def step_end(self, result: Any) -> None:
        if self._plan is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        source, plan = self._source, self._plan
        self._plan = None
        loader_step = hasattr(source, "plan_wait")   # the loader's Step, or run_plan's list of tensors
        lengths = source.lengths if loader_step else [_row_length(t) for t in source]
        meta = {k: getattr(source, k) if loader_step else None for k in ("step", "epoch", "index")}
        meta["supervised_tokens"] = getattr(result, "loss_tokens", None)   # the loss's denominator
        meta["fallback"] = bool(source.fallback) if loader_step else False
        if self.cuda:
            memory, meta["memory_kind"] = peak_allocated(self._device), "cuda_max_allocated"
        else:   # the process's peak resident set since it started (kilobytes on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            memory, meta["memory_kind"] = int(rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"
        mbs = self._mbs
        idle = sum(mb["end"] - mb["start"] for mb in mbs if mb["group_of"] is None)
        if self._busy:   # waiting inside collectives of this rank's own micro-batches
            idle += sum(max(0.0, mb["end"] - mb["start"] - mb["busy"]) for mb in mbs if mb["group_of"] is not None)
        rank = {"rank": self.rank, "seconds": now - self._begin, "check_seconds": self._checked - self._begin,
                "tail_seconds": now - self._checked - (mbs[-1]["end"] if mbs else 0.0),
                "plan_wait": float(getattr(source, "plan_wait", 0.0)),
                "load_seconds": float(getattr(source, "load_seconds", 0.0)), "idle_seconds": idle,
                "peak_memory_bytes": memory, "probe_seconds": 0.0, "micro_batches": mbs}
        events = [self._checked_event, self._marks, self._events.take()] if self.cuda else None
        rank["probe_seconds"] = self._probe + time.thread_time() - cpu
        self.sink(PendingStep(plan, lengths, meta, rank, events, self._events))


def _row_length(item: Any) -> int:
    """Tokens of one ``run_plan`` batch item: a token tensor, or a mapping with ``input_ids``."""
    return int((item["input_ids"] if isinstance(item, Mapping) else item).numel())


def peak_allocated(device: torch.device) -> int:
    """Peak bytes allocated on ``device`` since the last reset, read from the allocator's nested counters
    (``torch.cuda.max_memory_allocated`` first flattens every statistic into a Python dict)."""
    try:
        return int(torch._C._cuda_memoryStats(device.index if device.index is not None else
                                              torch.cuda.current_device())["allocated_bytes"]["all"]["peak"])
    except (AttributeError, KeyError, TypeError):   # another torch: the public call
        return int(torch.cuda.max_memory_allocated(device))
