"""Modelled communication for a replay: the cost model's all-to-all term, optionally with a measured
bandwidth table in place of its bandwidths. No torch.

A group of ``d > 1`` ranks moves ``comm_bytes_per_token * tokens / d`` bytes per rank per step (all
layers, forward and backward) at ``bandwidth[d]``, exactly the term ``CostModel.seq_time`` adds, so a
replayed group differs from its prediction only in compute.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flexsp.errors import CostModelError
from flexsp.inputs import _short_repr, read_json
from flexsp.plan.cost import CostModel


def load_bandwidth_table(path: str | Path) -> dict[int, float]:
    """Degree -> bytes/s from a JSON file: a cost model (its ``alltoall_bandwidth``, e.g. a
    ``flexsp profile`` run under torchrun), ``{"alltoall_bandwidth": {...}}``, or ``{"2": 1.2e9, ...}``."""
    data = read_json(path, "bandwidth table", CostModelError)   # the one capped reader of every JSON input
    return parse_bandwidth_table(data, f"bandwidth table {path}")


def parse_bandwidth_table(data: Any, where: str = "bandwidth table") -> dict[int, float]:
    if isinstance(data, Mapping) and "alltoall_bandwidth" in data:
        data = data["alltoall_bandwidth"]
    if not isinstance(data, Mapping) or not data:
        raise CostModelError(f"{where} must map SP degrees to bytes/s, e.g. {{\"2\": 5e9, \"4\": 4e9}}; "
                             f"got {_short_repr(data)}")
    table = {}
    for key, value in data.items():
        try:
            degree, bandwidth = int(key), float(value)
        except (TypeError, ValueError, OverflowError):
            raise CostModelError(f"{where}: entry {_short_repr(key)}: {_short_repr(value)} is not "
                                 f"degree: bytes/s") from None
        if not 2 <= degree <= 2**40 or not (math.isfinite(bandwidth) and bandwidth > 0):
            raise CostModelError(f"{where}: entry {_short_repr(key)}: {_short_repr(value)} needs a degree "
                                 f">= 2 and bytes/s > 0")
        table[degree] = bandwidth
    return dict(sorted(table.items()))


def with_bandwidth(cost: CostModel, table: Mapping[int, float], source: str) -> CostModel:
    """``cost`` with its all-to-all bandwidths replaced by ``table`` (recorded in ``meta``)."""
    data = cost.to_dict()
    data["alltoall_bandwidth"] = {str(d): bw for d, bw in table.items()}
    data["meta"] = dict(cost.meta, replay_bandwidth_source=source)
    return CostModel.from_dict(data)


def comm_time(cost: CostModel, tokens: int, degree: int) -> float:
    """Seconds of all-to-all one rank of a ``degree`` group spends on ``tokens`` tokens (0 for degree 1).
    In a Ulysses x ring group the all-to-all runs over the Ulysses ranks, at their bandwidth."""
    ulysses = cost.split(degree)[0]
    if ulysses == 1:
        return 0.0
    return cost.comm_bytes_per_token * tokens / degree / cost.bandwidth(ulysses)


def exposed_ring_time(cost: CostModel, lengths, degree: int) -> float:
    """Seconds of a Ulysses x ring group's K/V passing that attention does not hide, summed over its
    sequences: the cost model's ring term (bandwidth and per-hop latency) minus its attention estimate,
    where positive (the same overlap ``CostModel.seq_time`` models). 0 without a ring axis."""
    if cost.split(degree)[1] == 1:
        return 0.0
    _, _, ring = cost.coefficients(degree)
    s = np.asarray([float(n) for n in lengths], dtype=np.float64)
    exposed = ring * s + cost.ring_hops(degree) - cost.attention_seconds(s, degree)   # windows/chunks included
    return float(np.maximum(exposed, 0.0).sum())
