"""``TrainConfig``: the runtime's training settings in one frozen object, each default written once.

``shard_model`` and ``StepExecutor`` read it; an example or trainer builds one next to its
``PlanConfig`` so the sharding the cost model's capacity assumes and the sharding the runtime runs
are the same value (``flexsp.plan.memory``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from flexsp.errors import FlexSPError
from flexsp.plan.memory import DEFAULT as DEFAULT_SHARDING
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import check_recompute
from flexsp.runtime.kernels import BACKENDS


@dataclass(frozen=True)
class TrainConfig:
    """``sharding``: how FSDP2 shards model states ("full", "grad_optim", "none"); ``param_dtype``: the
    compute dtype (None: the parameters' own, e.g. fp64 tests), FSDP2's mixed-precision policy where the
    model is sharded, the executor's ``torch.autocast`` where it is not (world 1, "none": ``fsdp.py``);
    fp16 is refused (no loss scaling here); ``reduce_dtype``: FSDP2's gradient reduction dtype (None: the compute dtype); ``backend``: the local attention kernel (``flexsp.runtime.kernels``);
    ``recompute``: activation checkpointing ("none", "selective", "full"; the ``PlanConfig`` value, so the
    capacity the planner assumes is the memory the step keeps), applied by ``StepExecutor`` to a model with
    ``set_recompute``; None leaves the model's own setting."""

    sharding: str = DEFAULT_SHARDING
    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    backend: str = "auto"
    recompute: str | None = None

    def __post_init__(self) -> None:
        check_sharding(self.sharding)
        if self.recompute is not None:
            object.__setattr__(self, "recompute", check_recompute(self.recompute))
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise FlexSPError(f"{name} must be a torch.dtype or None, got {value!r}")
            if value is not None and not value.is_floating_point:   # autocast would drop it with a warning: fp32
                raise FlexSPError(f"{name} must be a floating-point dtype (bf16, fp16, fp32, fp64), got {value}")
        if self.param_dtype == torch.float16:
            raise FlexSPError("param_dtype=torch.float16 needs loss scaling, which the FlexSP step does not do: the "
                              "gradient of a mean over the global batch's supervised tokens underflows in fp16; use "
                              "torch.bfloat16 or torch.float32")
        if self.backend not in BACKENDS:
            raise FlexSPError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    def replace(self, **changes: Any) -> "TrainConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise FlexSPError(f"unknown training settings {unknown}; valid: "
                              f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, config: "TrainConfig | None", settings: dict[str, Any]) -> "TrainConfig":
        """The config an API call runs with: ``config`` (default ``TrainConfig()``) with keyword ``settings``
        applied; anything but a ``TrainConfig`` is named here, not as an AttributeError deep in the first step."""
        if config is not None and not isinstance(config, cls):
            raise FlexSPError(f"config must be a flexsp.runtime.TrainConfig, got {type(config).__name__} (keyword "
                              f"settings such as sharding='none' go by name)")
        config = config or cls()
        return config.replace(**settings) if settings else config
