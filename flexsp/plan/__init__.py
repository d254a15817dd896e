"""Planning, torch-free: from a batch of sequence lengths to a placed, validated ``Plan``.

| module | job |
|---|---|
| ``lengths`` | length files and distributions (bundled, approximations, the user's own) |
| ``specs`` | the one registry of model shapes (paper GPTs, Llamas, tiny test models) and GPUs |
| ``memory`` | model-state bytes per sharding and the one token-capacity formula |
| ``cost`` | ``CostModel``: the paper's alpha-beta time model and the capacity rule |
| ``analytic`` / ``presets`` | cost models from a model + GPU description / the paper's constants |
| ``measured_presets`` | cost models measured on real GPUs, shipped as JSON in ``measured/`` with provenance |
| ``communicator_memory`` | memory the SP communicators take from the capacity |
| ``cluster`` | ``Cluster`` and the tile placement rule (any degree: inside a node or whole nodes) |
| ``types`` | ``Plan``, ``MicroBatch``, ``Group``: JSON form and validation |
| ``strategies/`` | the strategy registry and one module per strategy |
| ``planner`` | ``plan_batch``: the front door (calls ``solver``, places groups on ranks) |
| ``bounds`` | lower bounds on a batch's step time |

Imports ``solver`` and numpy/scipy; never torch, never the runtime side.
"""
from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel
from flexsp.plan.types import Group, MicroBatch, Plan

__all__ = ["Cluster", "CostModel", "Plan", "Group", "MicroBatch"]
