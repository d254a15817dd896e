"""Memory: model-state sharding (the one setting the planner's capacity and the runtime share) and the
one token-capacity formula every cost model, the profiler and the runtime checks use.

A GPU's memory holds model states (parameters, gradients, optimizer states) and activations; the
cost model's ``token_capacity`` is what is left for activations. How much the states take depends on
how they are sharded over the ``N`` data-parallel ranks, so the choice lives here, once:

* ``"full"`` (ZeRO-3 / FSDP full shard): parameters, gradients and optimizer states all ``1/N``.
  The unsharded compute-precision copy of a block exists only while that block runs (transient);
  at ``N = 1`` nothing is wrapped and autocast's compute copy is held from forward to backward.
* ``"grad_optim"`` (ZeRO-2-like): gradients and optimizer states ``1/N``; the compute-precision
  parameters stay unsharded from forward to backward (FSDP2 ``reshard_after_forward=False``).
* ``"none"``: every rank holds everything (data parallel); the compute copy as above.

Bytes per parameter follow what the runtime (``flexsp.runtime.shard_model``, torch FSDP2 with
bf16 compute, fp32 master weights and fp32 gradient reduction) actually keeps, with Adam:
master weights 4, gradients 4 (FSDP2 keeps sharded gradients in the master dtype), optimizer 8
(two fp32 moments), compute copy 2 (bf16). So ``full`` is 16P/N (the paper's ZeRO-3 figure),
``grad_optim`` 2P + 16P/N and ``none`` 18P. Torch-free: the planner imports it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flexsp.errors import CostModelError

SHARDINGS = ("full", "grad_optim", "none")
_LEVEL = {"none": 0, "grad_optim": 1, "full": 2}          # more sharding = fewer bytes per GPU
DEFAULT = "full"                                          # what every cost model assumed before this setting


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one GPU holds, by kind (all already divided by N where sharded)."""

    params: float          # master weights, resident between steps
    grads: float           # gradients, resident from backward to the optimizer step
    optimizer: float       # optimizer states, resident
    compute_copy: float    # compute-dtype parameters held from forward to backward (0 if transient)

    @property
    def resident(self) -> float:
        """Parameters + gradients + optimizer states: what a rank holds after a step."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.resident + self.compute_copy


def check(sharding: str) -> str:
    """``sharding`` if it is one of ``SHARDINGS``, else ``CostModelError`` naming the choices."""
    if sharding not in SHARDINGS:
        raise CostModelError(f"unknown sharding {sharding!r}; choose one of {', '.join(SHARDINGS)}")
    return sharding


def state_bytes(params: float, num_gpus: int, sharding: str = DEFAULT, *, master_bytes: float = 4,
                grad_bytes: float = 4, optimizer_bytes: float = 8, compute_bytes: float = 2) -> StateBytes:
    """Model-state bytes per GPU for ``params`` parameters sharded ``sharding`` over ``num_gpus`` ranks.

    ``compute_bytes`` is the size of the compute-precision copy (0 when the model computes in its
    master dtype without a separate copy); ``optimizer_bytes`` 8 is Adam's two fp32 moments (0 for SGD).
    """
    check(sharding)
    if not num_gpus >= 1:
        raise CostModelError(f"num_gpus must be >= 1, got {num_gpus}")
    if not params >= 0:
        raise CostModelError(f"params must be >= 0, got {params}")
    n = 1 if sharding == "none" else num_gpus   # FSDP2 shards the fp32 master for "grad_optim" too
    # the compute copy is transient only under FSDP2's full shard; at one GPU the runtime does not wrap
    # (flexsp.runtime.shard_model) and autocast's bf16 copies of the weights live until backward
    copy = 0.0 if sharding == "full" and num_gpus > 1 else params * compute_bytes
    return StateBytes(params=params * master_bytes / n, grads=params * grad_bytes / n,
                      optimizer=params * optimizer_bytes / n, compute_copy=copy)


def model_state_bytes(params: float, num_gpus: int, sharding: str = DEFAULT, **bytes_per_param: float) -> float:
    """Total model-state bytes per GPU: the figure every cost model's ``token_capacity`` subtracts."""
    return state_bytes(params, num_gpus, sharding, **bytes_per_param).total


def assumed(meta: Mapping[str, Any] | Any) -> str:
    """The sharding a cost model's capacity assumed (``cost.meta["sharding"]``; ``"full"`` if unrecorded,
    which is what every capacity formula assumed before the setting existed). Takes a cost model or its meta."""
    meta = getattr(meta, "meta", meta) or {}
    return check(meta.get("sharding", DEFAULT))


def check_runtime(assumed_sharding: str, runtime_sharding: str) -> None:
    """Raise ``CostModelError`` if the capacity assumed more sharding than the runtime runs: its plans
    would put more tokens on a GPU than the memory left after the runtime's model states."""
    check(assumed_sharding), check(runtime_sharding)
    if _LEVEL[assumed_sharding] > _LEVEL[runtime_sharding]:
        raise CostModelError(
            f"the cost model's token capacity assumes sharding {assumed_sharding!r} but the runtime runs "
            f"{runtime_sharding!r}: its plans would overfill memory. Prepare the model with "
            f"shard_model(model, sharding={assumed_sharding!r}) or rebuild the cost model with "
            f"sharding={runtime_sharding!r}")


# --- activation recompute ------------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")
# Activation bytes one token keeps per layer per unit of hidden size (bf16; Megatron's count with a
# flash attention kernel, so no s^2 term): everything saved (34); the attention core recomputed in
# backward (its output and softmax statistics dropped: 34 - 2 - 2 = 30, q/k/v are kept as its inputs);
# every layer recomputed from its input (only the layer input kept: 2).
_ACTIVATION = {"none": 34, "selective": 30, "full": 2}
# Extra forward work recomputing costs, as multipliers on (attention, token-linear) compute: a step is
# forward + backward = 3 forward units, recompute adds one forward of what it recomputes.
_RECOMPUTE_WORK = {"none": (1.0, 1.0), "selective": (4 / 3, 1.0), "full": (4 / 3, 4 / 3)}


def check_recompute(recompute: str | bool) -> str:
    """``recompute`` as one of ``RECOMPUTE`` (``True``/``False``, the old flag, mean "full"/"none")."""
    if isinstance(recompute, bool) or type(recompute).__name__ == "bool_":
        return "full" if recompute else "none"
    if recompute not in RECOMPUTE:
        raise CostModelError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    return recompute


def activation_bytes_per_token(hidden: int, layers: int, recompute: str | bool = "none") -> float:
    """Analytic activation bytes one token keeps for backward over all layers, for this recompute setting."""
    return _ACTIVATION[check_recompute(recompute)] * hidden * layers


def recompute_work(recompute: str | bool = "none") -> tuple[float, float]:
    """(attention, token-linear) compute multipliers the recompute setting costs."""
    return _RECOMPUTE_WORK[check_recompute(recompute)]


def token_capacity(memory_bytes: float, state_bytes_per_gpu: float, activation_bytes_per_token: float, *,
                   usable_fraction: float = 1.0, what: str = "") -> int:
    """Activation tokens one GPU holds: ``floor((memory * usable_fraction - model states) / bytes per token)``.

    The one capacity formula: presets, analytic models and profiles all call it. ``what`` names the
    model and setting in the error raised when the states leave no room for a single token."""
    if not activation_bytes_per_token > 0:
        raise CostModelError(f"activation bytes per token must be > 0, got {activation_bytes_per_token}")
    if not 0 < usable_fraction <= 1:
        raise CostModelError(f"usable memory fraction must be in (0, 1], got {usable_fraction}")
    usable = memory_bytes * usable_fraction
    free = usable - state_bytes_per_gpu
    if free < activation_bytes_per_token:
        raise CostModelError(f"{what + ' ' if what else ''}model states leave no activation memory: they take "
                             f"{state_bytes_per_gpu / 2**30:.2f} GiB of the usable {usable / 2**30:.2f} GiB per GPU; "
                             f"shard them more, use more GPUs or more memory")
    return int(free // activation_bytes_per_token)
