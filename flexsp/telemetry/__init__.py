"""The closed loop: measure every executed step against its plan, and learn from it.

``Telemetry`` (torch) records each step on every rank through the executor's probe
(``StepRecorder``), gathers the records to rank 0 off the training thread and writes them as JSON
lines; ``refit`` refits the cost model from measured group times for the planner; ``report`` reads
a run directory back (``flexsp report RUN_DIR``). ``records``, ``refit`` and ``report`` are
torch-free; the torch names load on first use.
"""
from __future__ import annotations

from typing import Any

from flexsp.telemetry.records import TelemetryError, model_flops, peak_flops, read_records
from flexsp.telemetry.refit import RefitConfig, Refitter

_TORCH_NAMES = {"Telemetry": "session", "StepRecorder": "recorder"}

__all__ = ["TelemetryError", "model_flops", "peak_flops", "read_records", "RefitConfig", "Refitter", *_TORCH_NAMES]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        import importlib
        return getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'flexsp.telemetry' has no attribute {name!r}")
