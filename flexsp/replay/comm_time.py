"""Modelled communication for a replay: the cost model's all-to-all term, optionally with a measured
bandwidth table in place of its bandwidths. No torch.

A group of ``d > 1`` ranks moves ``alltoall_bytes(u) * tokens / d`` bytes per rank per step (all
layers, forward and backward; ``u`` its Ulysses part) at ``bandwidth[u]``, exactly the term ``CostModel.seq_time`` adds, so a
replayed group differs from its prediction only in compute.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flexsp.errors import CostModelError
from flexsp.inputs import _short_repr, integer_keys, number, read_json
from flexsp.plan.cost import CostModel


def load_bandwidth_table(path: str | Path) -> dict[int, float]:
    """Degree -> bytes/s from a JSON file: a cost model (its ``alltoall_bandwidth``, e.g. a
    ``flexsp profile`` run under torchrun), ``{"alltoall_bandwidth": {...}}``, or ``{"2": 1.2e9, ...}``."""
    data = read_json(path, "bandwidth table", CostModelError)   # the one capped reader of every JSON input
    return parse_bandwidth_table(data, f"bandwidth table {path}")


def parse_bandwidth_table(data: Any, where: str = "bandwidth table") -> dict[int, float]:
    """Degree -> bytes/s, read as strictly as a cost model's ``alltoall_bandwidth``: keys the decimal
    digits of a degree >= 2, each once; values JSON numbers > 0 (``"5e9"`` or ``true`` are refused, not
    read as 5e9 or 1)."""
    if isinstance(data, Mapping) and "alltoall_bandwidth" in data:
        data = data["alltoall_bandwidth"]
    if not isinstance(data, Mapping) or not data:
        raise CostModelError(f"{where} must map SP degrees to bytes/s, e.g. {{\"2\": 5e9, \"4\": 4e9}}; "
                             f"got {_short_repr(data)}")
    table = {}
    for degree, value in integer_keys(data, where, CostModelError, "SP degree").items():
        if not 2 <= degree <= 2**40:
            raise CostModelError(f"{where}: entry {degree}: needs a degree >= 2 (degree 1 has no all-to-all) "
                                 f"and at most 2**40")
        table[degree] = number(value, f"{where}[{degree}] (bytes/s)", CostModelError, positive=True)
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
    return cost.alltoall_bytes(ulysses) * tokens / degree / cost.bandwidth(ulysses)


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
