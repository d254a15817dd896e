"""``Telemetry``: per-step records of a training run gathered to rank 0, written, logged and learnt from::

    telemetry = Telemetry("runs/exp1", cost, spec=model_spec, refit=True, on_refit=loader.set_cost)
    executor = StepExecutor(model, optimizer, pool, cost=cost, probe=telemetry.probe)
    for step in loader:
        executor.step(step)
    telemetry.close()

Build it on every rank at the same point (with several ranks it creates a gloo side group). Each
rank's ``StepRecorder`` hands its measured step to a background thread, which gathers the ranks'
records to rank 0 on that side group: no collective is added to the training thread, which never
waits for telemetry. Rank 0 writes one JSON line per step (``records.jsonl``), a TensorBoard event
file when ``tensorboard`` is installed, and a one-line log every ``log_every`` steps. With
``refit``, rank 0 refits the cost model from the measured group times (``refit.py``) and hands each
new model to ``on_refit`` (e.g. ``FlexSPLoader.set_cost``) on the training thread at the start of
the next step, so later plans use it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import queue
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flexsp.plan.cost import CostModel
from flexsp.plan.specs import ModelSpec
from flexsp.telemetry.records import REFITS, RECORDS, RUN, TelemetryError, build_record
from flexsp.telemetry.records import peak_flops as device_peak
from flexsp.telemetry.recorder import PendingStep, StepRecorder
from flexsp.telemetry.refit import RefitConfig, Refitter

SCALARS = ("seconds", "tokens_per_s", "mfu", "idle_fraction", "loader_fraction", "planned_error", "plan_wait",
           "load_seconds", "peak_memory_bytes")


class Telemetry:
    """Records every step of a run into ``run_dir`` (module docstring). ``close()`` when done (or ``with``)."""

    def __init__(self, run_dir: str | Path, cost: CostModel, *, spec: ModelSpec | None = None,
                 peak_flops: float | None = None, device: torch.device | str | None = None, log_every: int = 10,
                 refit: bool | RefitConfig = False, on_refit: Callable[[CostModel], None] | None = None,
                 tensorboard: bool | None = None, timeout: float = 300.0, log: Callable[[str], None] | None = None,
                 enabled: bool = True) -> None:
        if not isinstance(cost, CostModel):
            raise TelemetryError(f"cost must be a flexsp.CostModel, got {type(cost).__name__}")
        if not isinstance(log_every, int) or log_every < 0:
            raise TelemetryError(f"log_every must be an integer >= 0 (0: no log line), got {log_every!r}")
        initialized = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        self.run_dir, self.cost, self.spec, self.log_every = Path(run_dir), cost, spec, log_every
        # default: the GPU this rank trains on where there is one (init_distributed sets it from LOCAL_RANK); CPU
        # timing around a CUDA step would time kernel launches, not kernels
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak_flops = device_peak(name, peak_flops)
        self._log = log or _print
        self.refitter = Refitter(cost, refit if isinstance(refit, RefitConfig) else None) if refit else None
        self.on_refit = on_refit
        self.error: str | None = None   # why recording stopped on this rank, if it did
        self.dropped = 0                 # step records rank 0 could not write
        self.thread_seconds = 0.0        # CPU time the telemetry thread spent (gathers, records, refits)
        self.records = 0
        self._fallbacks = 0   # since the last log line
        self._pending_cost: CostModel | None = None
        self._lock = threading.Lock()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if self.world > 1 else None
        self._files: dict[str, Any] = {}
        self._tb = None
        if self.rank == 0:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / RUN).write_text(json.dumps({
                    "world": self.world, "device": name, "peak_flops": self.peak_flops,
                    "model": None if spec is None else {**spec.shape(), "params": spec.params},
                    "cost_model": cost.to_dict(), "refit": None if self.refitter is None
                    else dataclasses.asdict(self.refitter.config), "started": time.time()}, indent=1, default=str) + "\n")
                self._files[RECORDS] = (self.run_dir / RECORDS).open("a")
                if self.refitter is not None:
                    self._files[REFITS] = (self.run_dir / REFITS).open("a")
            except OSError as exc:
                raise TelemetryError(f"cannot write the run directory {self.run_dir}: {exc.strerror or exc}") from None
            if tensorboard or tensorboard is None:
                self._tb = _summary_writer(self.run_dir, required=bool(tensorboard))
        self._queue: queue.Queue[PendingStep | None] = queue.Queue()
        self.probe = StepRecorder(self._queue.put, rank=self.rank, device=self.device, on_begin=self._apply_refit)
        self.probe.enabled = enabled
        self._thread = threading.Thread(target=self._work, name="flexsp-telemetry", daemon=True)
        self._thread.start()

    # --- training thread --------------------------------------------------------------------------
    def _apply_refit(self) -> None:
        with self._lock:
            cost, self._pending_cost = self._pending_cost, None
        if cost is not None and self.on_refit is not None:
            self.on_refit(cost)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every step handed over so far is written (tests, the end of a run)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, stop the thread, close the files. Call on every rank."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "Telemetry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- telemetry thread -------------------------------------------------------------------------
    def _work(self) -> None:
        if self.device.type == "cuda":   # this thread's CUDA calls (event reads) on the rank's GPU, not a new context on 0
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            started = time.thread_time()
            try:
                if item is None:
                    return
                if self.error is None:
                    ranks = self._gather(item)
                    if ranks is not None:
                        self._write(item, ranks)
            finally:
                self.thread_seconds += time.thread_time() - started
                self._queue.task_done()

    def _gather(self, item: PendingStep) -> list[dict[str, Any]] | None:
        """Every rank's record on rank 0 (None elsewhere). A failed gather stops recording on this rank
        (telemetry never stops training); the peers' gathers then end at the side group's timeout."""
        try:
            mine = item.rank_record()
            if self._group is None:
                return [mine]
            ranks = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, ranks, dst=0, group=self._group)
            return ranks
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.probe.enabled = False
            self._log(f"telemetry stopped on rank {self.rank}: {self.error}")
            return None

    def _write(self, item: PendingStep, ranks: list[dict[str, Any]]) -> None:
        """Rank 0: the step record, its line, TensorBoard, the log line and the refit. A failure here drops
        this step's record (said once) but keeps gathering, so no peer waits."""
        try:
            self._record(item, ranks)
        except Exception as exc:
            self.dropped += 1
            if self.dropped == 1:
                self._log(f"telemetry: a step record could not be written ({type(exc).__name__}: {exc}); "
                          f"later failures are counted in Telemetry.dropped")

    def _record(self, item: PendingStep, ranks: list[dict[str, Any]]) -> None:
        cost = self.refitter.cost if self.refitter is not None else self.cost
        version = self.refitter.version if self.refitter is not None else 0
        record = build_record(item.plan, item.lengths, ranks, cost, meta=item.meta, spec=self.spec,
                              peak=self.peak_flops, cost_version=version, now=time.time())
        if record["step"] is None:
            record["step"] = self.records
        self._files[RECORDS].write(json.dumps(record, allow_nan=False) + "\n")
        self._files[RECORDS].flush()
        self.records += 1
        if self._tb is not None:
            for key in SCALARS:
                if record[key] is not None:
                    self._tb.add_scalar(f"flexsp/{key}", record[key], record["step"])
        self._fallbacks += record["fallback"]
        if self.log_every and self.records % self.log_every == 0:
            self._log(log_line(record, self._fallbacks, self.log_every))
            self._fallbacks = 0
        if self.refitter is not None:
            self.refitter.observe_record(record)
            if self.refitter.due():
                new = self.refitter.refit()
                if new is not None:
                    info = new.meta["refit"]
                    self._files[REFITS].write(json.dumps({"step": record["step"], **info,
                                                          "cost_model": new.to_dict()}, default=str) + "\n")
                    self._files[REFITS].flush()
                    with self._lock:
                        self._pending_cost = new
                    self._log(f"refit v{info['version']} after step {record['step']}: window error "
                              f"{info['error_before']:.1%} -> {info['error_after']:.1%} ({info['points']} groups)")


def log_line(record: dict[str, Any], fallbacks: int, steps: int) -> str:
    """``step 40 | 12,345 tok/s | MFU 31.2% | planned/measured 0.97 | idle 8% | loader 1% | fallbacks 0/10 | cost v2``:
    this step's figures and the fallback plans used over the last ``steps`` steps."""
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.3g}%"
    measured = sum(mb["measured"] for mb in record["micro_batches"])
    ratio = record["planned_seconds"] / measured if measured > 0 else math.nan
    return (f"step {record['step']} | {record['tokens_per_s']:,.0f} tok/s | MFU {mfu} | planned/measured "
            f"{ratio:.2f} | idle {record['idle_fraction']:.0%} | loader {record['loader_fraction']:.0%} | "
            f"fallbacks {fallbacks}/{steps} | cost v{record['cost_version']}")


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")   # one write: the line is not split by the training thread's own prints
    sys.stdout.flush()


def _summary_writer(run_dir: Path, required: bool):
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if required:
            raise TelemetryError("tensorboard=True but the tensorboard package is not installed "
                                 "(pip install tensorboard)") from None
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))
