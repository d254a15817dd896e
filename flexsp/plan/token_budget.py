"""The made-up cost model of a run with no profile: a per-rank token budget and rough constants.

``flexsp.hf.trainer`` plans with it when ``flexsp_tokens_per_rank`` is given without ``flexsp_cost``;
it lives here, torch-free, so the planner benchmarks can time the plans a Trainer run makes without
importing transformers.
"""
from __future__ import annotations

from flexsp.plan.cluster import tileable_degrees
from flexsp.plan.cost import CostModel


def token_budget_cost(num_layers: int, hidden_size: int, world: int, tokens_per_rank: int,
                      gpus_per_node: int = 8) -> CostModel:
    """A cost model of the right shape (profile yours: ``flexsp profile --hf-config DIR``) for a model of
    ``num_layers`` x ``hidden_size`` on ``world`` ranks holding ``tokens_per_rank`` tokens each.

    ``gpus_per_node``: the cluster's node size (every group size it tiles gets a bandwidth). ``tokens_per_rank`` is the budget left
    after the model states; the Trainer keeps them replicated
    (sharding ``"none"``), which is what the capacity is recorded as."""
    degrees = tileable_degrees(world, gpus_per_node)[1:]   # every group size the cluster tiles (nodes of 6: 3, 6, 12)
    return CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4,
                     comm_bytes_per_token=4 * 2 * num_layers * hidden_size * 4,
                     alltoall_bandwidth={d: 2e9 / d for d in degrees}, token_capacity=tokens_per_rank,
                     meta={"sharding": "none", "source": "made up by flexsp.hf.trainer.default_cost"})


__all__ = ["token_budget_cost"]
