"""Evaluation: how good a plan is, never how to make or run one.

``simulate`` (many sampled batches, several strategies, the ``flexsp simulate`` command),
``bounds`` (lower bounds on a batch's step time), ``megatron`` (a Megatron-LM step-time model the
end-to-end comparison uses) and ``plots``. Nothing in the planner, solver or runtime imports this
package; submodules are imported on use (``plots`` pulls in matplotlib).
"""
