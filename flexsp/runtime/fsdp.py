"""``shard_model``: shard a model's states with torch FSDP2 the way the cost model's capacity assumes.

``fully_shard`` is applied to each of ``model.fsdp_units()`` (decoder layers), then to the root, so
each layer's parameters are all-gathered just before it runs and its gradients reduce-scattered as
soon as its backward is done (overlapping the rest of backward). The sharding choice is the one in
``flexsp.plan.memory`` and the same string the cost model records:

* ``"full"``: ZeRO-3 (``reshard_after_forward=True``): a layer's unsharded parameters live only while it runs.
* ``"grad_optim"``: the compute copy stays unsharded from forward to backward; gradients and
  optimizer states (and the fp32 master) are sharded.
* ``"none"``: every rank holds all states: plain data parallelism.

Nothing is wrapped where sharding buys nothing: at world size 1 (whatever the sharding: one rank's
shard is everything) or with ``"none"``. The model stays a plain module - no per-layer hooks,
all-gathers or copies (at world 1 FSDP2 costs ~12x the Python calls per layer of the plain module).
The executor then sums its gradients over ranks with one all-reduce per 25 MiB bucket at the end of the
step (``step.py``), the same sum FSDP2 reduces, in the parameters' dtype (fp32; ``reduce_dtype`` is
FSDP2's setting). Mixed precision for such a model is ``torch.autocast``, what a single-GPU user
writes: ``shard_model`` records ``param_dtype`` (``autocast_dtype(model)``) and ``StepExecutor`` runs
every forward under ``torch.autocast(device, dtype=param_dtype)``, backward and optimizer outside it.

Numerics of the two mixed-precision paths (both: fp32 master weights updated by the optimizer, fp32
gradients on them, the loss's softmax in fp32):

* FSDP2 (``MixedPrecisionPolicy(param_dtype)``) casts the *parameters* to bf16 once per layer, so
  every op of the layer runs in bf16: norms' weights, the residual stream between layers, the
  embedding output. Parameter gradients are bf16 and upcast for the fp32 reduction.
* autocast casts per *op*: matmuls / linear layers (and attention on their bf16 outputs) run in bf16;
  other ops keep their inputs' dtype, so the embedding output, the residual stream, norms and their
  weights stay fp32, and each matmul's weight gradient is cast back to fp32 where it meets its fp32
  parameter. So autocast rounds less (the residual stream is never bf16) and differs from the
  FSDP2 path by bf16 rounding, not by method. Memory: the bf16 weight copies autocast makes are saved
  for backward (the same 2 bytes per parameter as FSDP2's unsharded compute copy under ``"none"``), and
  activations kept in fp32 by the residual stream and norms are twice their bf16 size.

Mixed precision under FSDP2: parameters are kept in fp32 (the master weights the optimizer updates), cast
to ``param_dtype`` (bf16 by default) for compute, gradients reduced in ``reduce_dtype`` (fp32). Gradients are SUMMED over
ranks (divide factor 1): the executor already divides each shard's loss by the global count of supervised targets.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexsp.errors import FlexSPError
from flexsp.runtime.config import TrainConfig

SHARDING_ATTR = "flexsp_sharding"
AUTOCAST_ATTR = "flexsp_autocast"
PARAM_DTYPE_ATTR = "flexsp_param_dtype"   # the param_dtype shard_model prepared the model for (FSDP2 or autocast)


class PrecisionError(FlexSPError):
    """The compute dtype asked of ``StepExecutor`` is not the one the model was prepared for, or cannot be
    applied to it (half-precision or fp64 parameters, a model FSDP-wrapped outside ``shard_model``)."""


def runtime_sharding(model: nn.Module, unprepared: str | None = "none") -> str | None:
    """The sharding ``shard_model`` applied to ``model``; ``unprepared`` for a model it never saw."""
    return getattr(model, SHARDING_ATTR, unprepared)


def autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``StepExecutor`` autocasts a plain (unwrapped) model's forward to; None: no autocast."""
    return getattr(model, AUTOCAST_ATTR, None)


def step_autocast(model: nn.Module, requested: torch.dtype | None, explicit: bool) -> torch.dtype | None:
    """The dtype ``StepExecutor`` autocasts ``model``'s forward to (None: none), or ``PrecisionError``.

    ``requested`` is the executor's ``TrainConfig.param_dtype``; ``explicit`` says the caller set it (a
    ``config`` or ``param_dtype=``), rather than leaving the model's own preparation in charge. A model
    ``shard_model`` prepared keeps its compute dtype (FSDP2's policy or the recorded autocast); asking for
    another is refused. A plain fp32 model asked for bf16/fp16 gets the autocast ``shard_model``'s world-1
    path records, so ``param_dtype`` is never silently ignored; what autocast cannot give (fp64 or half
    parameters computing in another dtype) is refused.
    """
    params = next(model.parameters()).dtype
    same = lambda a, b: (a or params) == (b or params)   # noqa: E731  (None: the parameters' own dtype)
    computes = getattr(model, PARAM_DTYPE_ATTR, autocast_dtype(model)) if hasattr(model, SHARDING_ATTR) else requested
    if (computes or params) == torch.float16:   # asked for by name, or fp16 weights computing in their own dtype
        raise PrecisionError("fp16 compute needs loss scaling, which the FlexSP step does not do: the gradient of a "
                             "mean over the global batch's supervised tokens underflows in fp16; use bf16 or fp32 "
                             "(param_dtype=torch.bfloat16 on fp32 weights)")
    if hasattr(model, SHARDING_ATTR):
        prepared = getattr(model, PARAM_DTYPE_ATTR, autocast_dtype(model))
        if explicit and not same(requested, prepared):
            raise PrecisionError(f"the model was prepared by shard_model for param_dtype {prepared} but the "
                                 f"executor's config asks for {requested}: pass the same TrainConfig to shard_model "
                                 f"and StepExecutor")
        return None if is_sharded(model) else autocast_dtype(model)
    if not explicit or same(requested, None):
        return None
    if is_sharded(model):
        raise PrecisionError(f"param_dtype {requested}: the model is FSDP-wrapped outside shard_model, so its own "
                             f"MixedPrecisionPolicy sets the compute dtype; prepare it with "
                             f"flexsp.runtime.shard_model, or pass param_dtype=None")
    if params != torch.float32 or requested not in (torch.bfloat16, torch.float16):
        raise PrecisionError(f"param_dtype {requested} cannot be applied to {params} parameters by autocast (it lowers "
                             f"fp32 to bf16/fp16 only); prepare the model with flexsp.runtime.shard_model (fp32 master "
                             f"weights), or pass param_dtype=None to compute in {params}")
    return requested


def shard_model(model: nn.Module, config: TrainConfig | None = None, **settings: Any) -> nn.Module:
    """Shard ``model`` (an ``SPModel`` already on its device) over the default process group in place.

    ``config`` (a ``TrainConfig``; keyword ``settings`` such as ``sharding="none"`` override it) gives the
    sharding and the dtypes. ``param_dtype=None`` computes in the parameters' own dtype (fp64 tests); ``reduce_dtype`` then
    defaults to that dtype too. Half-precision parameters are first upcast to fp32: the optimizer
    must update fp32 master weights, or small updates vanish in bf16 rounding.
    Returns the same module (an FSDP module, or left plain where sharding buys nothing, with its
    ``param_dtype`` recorded for the executor's autocast: see above); build the optimizer after this call.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    config = TrainConfig.of(config, settings)
    sharding, param_dtype, reduce_dtype = config.sharding, config.param_dtype, config.reduce_dtype
    if not (dist.is_available() and dist.is_initialized()):
        raise FlexSPError("shard_model needs an initialised process group (torch.distributed.init_process_group); "
                          "a single process can run a world of one")
    if isinstance(model, FSDPModule) or hasattr(model, SHARDING_ATTR):
        raise FlexSPError("the model is already prepared (FSDP-sharded); call shard_model once")
    for name in ("fsdp_units", "shard_loss", "sp_heads"):
        if not callable(getattr(model, name, None)):
            raise FlexSPError(f"{type(model).__name__} has no {name}(): shard_model needs an SPModel "
                              f"(flexsp.runtime.models.protocol)")
    params = list(model.parameters())
    if not params:
        raise FlexSPError(f"{type(model).__name__} has no parameters to shard")
    if any(p.dtype in (torch.float16, torch.bfloat16) for p in params):
        model.float()
    device = params[0].device
    world = dist.get_world_size()
    setattr(model, PARAM_DTYPE_ATTR, param_dtype)   # what StepExecutor checks its own config against
    if world == 1 or sharding == "none":
        setattr(model, SHARDING_ATTR, sharding)   # what the cost model may assume: at world 1 every sharding is one
        if param_dtype not in (None, next(model.parameters()).dtype):
            setattr(model, AUTOCAST_ATTR, param_dtype)   # mixed precision without FSDP: the executor's autocast
        return model
    if sharding == "none":
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    if param_dtype is None and reduce_dtype == torch.float32:
        reduce_dtype = None   # no mixed precision: reduce in the parameters' dtype (fp64 stays exact)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = sharding == "full"
    units = list(model.fsdp_units())
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # the root's entry points besides forward unshard it like forward does (a router model's statistics pre-pass
    # calls batch_statistics on the root directly)
    for method in ("shard_loss", "batch_statistics"):
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    for module in [*units, model]:
        module.set_gradient_divide_factor(1.0)          # sum, not mean, over ranks
        module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    setattr(model, SHARDING_ATTR, sharding)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)
