"""A lower bound on any plan's step time, to say how far a plan is from optimal."""
from __future__ import annotations

import math

import numpy as np

from .cluster import Cluster
from .cost import CostModel
from .planner import usable_degrees


def lower_bound(lengths, cost: CostModel, cluster: Cluster, max_degree: int | None = None,
                degrees=None) -> float:
    """Every sequence at its cheapest degree (GPU-seconds) spread perfectly over all GPUs, plus
    beta1 for each of the fewest micro-batches whose memory could hold the batch."""
    lengths = np.asarray(lengths, dtype=np.float64)
    costs = cost.degree_costs(usable_degrees(cluster, max_degree, degrees))
    area = (costs.times(lengths) * np.asarray(costs.degrees)[None, :]).min(axis=1)
    micro_batches = max(1, math.ceil(lengths.sum() / (cost.token_capacity * cluster.num_gpus) - 1e-12))
    return float(area.sum()) / cluster.num_gpus + cost.beta1 * micro_batches
