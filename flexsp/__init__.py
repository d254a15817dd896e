"""FlexSP: heterogeneous sequence parallelism for variable-length LLM training."""
from .cluster import Cluster
from .cost import CostModel
from .errors import ClusterError, CostModelError, FlexSPError, LengthsError, PlanError
from .plan import Group, MicroBatch, Plan

__all__ = ["Cluster", "CostModel", "Plan", "Group", "MicroBatch", "FlexSPError", "ClusterError",
           "CostModelError", "PlanError", "LengthsError", "plan_batch"]
__version__ = "0.1.0"


def __getattr__(name):  # plan_batch pulls in the solver; import it on first use
    if name == "plan_batch":
        from .planner import plan_batch
        return plan_batch
    raise AttributeError(f"module 'flexsp' has no attribute {name!r}")
