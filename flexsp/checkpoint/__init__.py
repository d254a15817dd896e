"""Fault tolerance: checkpoints of sharded model, optimizer, loader and RNG state; atomic on disk.

``Checkpointer`` (torch) is loaded on first use; ``layout`` and ``CheckpointError`` are torch-free.
"""
from __future__ import annotations

from typing import Any

from flexsp.checkpoint.errors import CheckpointError

__all__ = ["Checkpointer", "CheckpointError"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from flexsp.checkpoint.checkpointer import Checkpointer
        return Checkpointer
    raise AttributeError(f"module 'flexsp.checkpoint' has no attribute {name!r}")
