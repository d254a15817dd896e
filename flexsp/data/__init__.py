"""Planned, per-rank micro-batches for training: the FlexSP data loader.

``FlexSPLoader(dataset, cost, cluster, LoaderConfig(batch_size=...), pool=pool)`` forms global
batches from a map-style dataset, plans each with ``plan_batch`` in a background process, and yields
for this rank the packed shards of every micro-batch it takes part in. The torch-free parts
(config, batching, planning, lengths) import without torch; ``FlexSPLoader``, ``Step`` and
``MicroBatchShard`` load torch on first use. The bundled length distributions are not here:
``flexsp/lengths_data/`` holds them, read by ``flexsp.plan.lengths``.
"""
from __future__ import annotations

from typing import Any

from flexsp.data.batching import EpochBatches, GlobalBatch
from flexsp.data.config import LoaderConfig
from flexsp.data.errors import LoaderError, PlannerError
from flexsp.data.planning import AsyncPlanner, PlanBatch, PlannedBatch, PlannerStats
from flexsp.data.source import resolve_lengths

_TORCH_NAMES = {"FlexSPLoader": "loader", "Step": "loader", "LoaderStats": "loader",
                "MicroBatchShard": "collate", "to_tokens": "collate"}

__all__ = ["LoaderConfig", "LoaderError", "PlannerError",
           "EpochBatches", "GlobalBatch", "AsyncPlanner", "PlanBatch", "PlannedBatch",
           "PlannerStats", "resolve_lengths", *_TORCH_NAMES]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        import importlib
        return getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'flexsp.data' has no attribute {name!r}")
