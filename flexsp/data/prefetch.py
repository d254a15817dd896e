"""Prepare the loader's next step on a background thread while the current step trains.

A step's preparation (the plan's broadcast, fetching this rank's items, packing and sharding them, the
host-to-device copies) used to run on the training thread between two steps, so the loop waited for
it every step. ``Prefetch`` runs one preparation on a daemon thread; the loop collects it with
``result()`` when it needs the step. On a GPU the preparation runs on a side CUDA stream (its copies
overlap the current step's kernels); ``result()`` makes the caller's stream wait for them (an event:
no host sync) and marks each tensor as used on that stream, so the caching allocator does not hand
its memory back to the side stream while the caller's kernels still read it.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch

T = TypeVar("T")


class Prefetch(Generic[T]):
    """``prepare()`` running on its own daemon thread; ``result()`` waits for its value or re-raises its error.

    ``stream``: a CUDA stream (on the loader's device) to prepare on; None on a CPU."""

    def __init__(self, prepare: Callable[[], T], stream: "torch.cuda.Stream | None" = None) -> None:
        self._prepare, self._stream = prepare, stream
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._ready: "torch.cuda.Event | None" = None
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="flexsp-loader-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._stream is None:
                self._value = self._prepare()
            else:
                with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
                    self._value = self._prepare()
                    self._ready = torch.cuda.Event()
                    self._ready.record(self._stream)
        except BaseException as exc:   # handed to the training thread by result()
            self._error = exc
        finally:
            self.finished_at = time.perf_counter()
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the preparation to end (with a value or an error)."""
        return self._done.wait(timeout)

    def result(self) -> T:
        """The prepared value, usable on the caller's current stream; the preparation's error is raised here."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._ready is not None:
            current = torch.cuda.current_stream(self._stream.device)
            current.wait_event(self._ready)
            for t in device_tensors(self._value):
                t.record_stream(current)
        return self._value


def device_tensors(obj: Any, depth: int = 6) -> Iterator[torch.Tensor]:
    """The CUDA tensors inside ``obj``: its dataclass fields (but those marked ``host_only``, ``step.HOST_ONLY``),
    tuples, lists and dicts, ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
        return
    if depth == 0:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if not f.metadata.get("host_only"):   # a step's plan, indices, lengths: host data, long at scale
                yield from device_tensors(getattr(obj, f.name), depth - 1)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from device_tensors(item, depth - 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from device_tensors(item, depth - 1)
