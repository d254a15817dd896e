"""FlexSP: heterogeneous sequence parallelism for variable-length LLM training."""
from flexsp.errors import ClusterError, CostModelError, FlexSPError, LengthsError, PlanError
from flexsp.plan.analytic import cost_from_hardware
from flexsp.plan.cluster import Cluster
from flexsp.plan.config import PlanConfig
from flexsp.plan.cost import CostModel
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.types import Group, MicroBatch, Plan

__all__ = ["Cluster", "CostModel", "cost_from_preset", "cost_from_hardware", "PlanConfig", "Plan", "Group", "MicroBatch", "FlexSPError", "ClusterError",
           "CostModelError", "PlanError", "LengthsError", "plan_batch"]
__version__ = "0.1.0"


def __getattr__(name):  # plan_batch pulls in the solver; import it on first use
    if name == "plan_batch":
        from flexsp.plan.planner import plan_batch
        return plan_batch
    raise AttributeError(f"module 'flexsp' has no attribute {name!r}")
