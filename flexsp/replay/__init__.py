"""Replay a plan on one device: measured compute per group, modelled communication.

For every group of every micro-batch, the rank of that group with the most work (and any rank whose
work differs materially) runs its forward and backward through the runtime's model code, with the
Ulysses all-to-all replaced by ``LocalExchange``, a local stand-in with the same post-exchange shapes.
Communication comes from the cost model's bandwidths or a measured table. The result compares, per
group, micro-batch and step, the makespan with measured compute against the cost model's prediction.

| module | job | torch |
|---|---|---|
| ``exchange`` | ``LocalExchange``: the all-to-all stand-in | yes |
| ``runner`` | ``ReplayModel``, representative ranks, timing one rank | yes |
| ``replay`` | ``Replayer`` / ``replay_plan``: checks, every group, the report | yes |
| ``comm_time`` | modelled all-to-all time, bandwidth tables | no |
| ``budget`` | device seconds a replay will take, before it runs (device-time budgets) | no |
| ``report`` | ``ReplayReport``: makespans, JSON, Markdown | no |
| ``plot`` | Gantt chart, predicted above replayed | no |
| ``cli`` | ``flexsp replay`` and ``flexsp simulate --replay`` | lazily |

Importing this package does not import torch; the torch parts load on first use.
"""
from __future__ import annotations

from importlib import import_module

from flexsp.replay.comm_time import comm_time, load_bandwidth_table, with_bandwidth
from flexsp.replay.report import GroupReplay, ReplayReport, format_groups, summary

_LAZY = {"LocalExchange": "exchange", "ReplayModel": "runner", "ReplayError": "runner", "RankRunner": "runner",
         "representative_ranks": "runner", "Replayer": "replay", "replay_plan": "replay",
         "check_replayable": "replay", "plot_replay_gantt": "plot"}

__all__ = ["GroupReplay", "ReplayReport", "format_groups", "summary", "comm_time", "load_bandwidth_table",
           "with_bandwidth", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
