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
# Compute precision paths (flexsp.runtime.fsdp): "autocast" is the unwrapped model (world 1, or sharding
# "none") with fp32 parameters under torch.autocast(bf16): the residual stream and norms stay fp32;
# "bf16" is FSDP2's MixedPrecisionPolicy(param_dtype=bf16): every parameter cast, the residual stream bf16.
PRECISIONS = ("autocast", "bf16")
# Bytes one token keeps for backward in one softmax-attention layer, per unit of width
# (hidden, q_dim = heads x head size, kv_dim = kv heads x head size, ffn, heads), by what builds the layer,
# the precision path and the recompute setting. What each is (flexsp.profile.activations measures them from
# the saved tensors; tests/profile/test_activations.py holds the model to within 10% of that):
# * hidden: each RMSNorm saves its input and its normalised output, fp32 under autocast (2 norms x 8 = 16),
#   plus one bf16 cast of the norm output per projection reading it (TinyLM: q, kv | gate_up = 3 casts, 6;
#   transformers' Llama-style layers: q, k, v | gate, up = 5 casts, 10); under bf16 each norm keeps its fp32
#   upcast (4), the bf16 result (2) and its product with the weight (2): 16, no casts.
# * q_dim: the rotated q, the attention output and the out-projection's input (2 bytes each).
# * kv_dim: TinyLM's fused kv projection output (k and v, 4) and the rotated k (2); transformers' layers the
#   rotated k and v (2 + 2).
# * ffn: the gate-up projection output (4), silu(gate) (2) and their product, the down-projection's input (2).
# * heads: the attention's log-sum-exp, fp32.
# "selective" recomputes the attention core: its output and log-sum-exp are not kept; "full" keeps only
# the layer's input (fp32 under autocast: 4, bf16: 2). This replaces Korthikanti et al.'s 34 x hidden (an
# all-bf16 count with fused kernels), which was ~half what TinyLM keeps under autocast.
_SAVED = {
    ("flexsp", "autocast"): {"none": (22, 6, 6, 8, 4), "selective": (22, 4, 6, 8, 0), "full": (4, 0, 0, 0, 0)},
    ("flexsp", "bf16"): {"none": (16, 6, 6, 8, 4), "selective": (16, 4, 6, 8, 0), "full": (2, 0, 0, 0, 0)},
    ("transformers", "autocast"): {"none": (26, 6, 4, 8, 4), "selective": (26, 6, 6, 8, 0),
                                   "full": (4, 0, 0, 0, 0)},
    ("transformers", "bf16"): {"none": (16, 6, 4, 8, 4), "selective": (16, 4, 4, 8, 0), "full": (2, 0, 0, 0, 0)},
}
# Gemma 2/3/4's layers add a norm after the attention and after the FFN ("sandwich" norms): measured on their
# transformers layers (flexsp.profile.activations, several shapes), 16 x hidden more under autocast and 20 x
# hidden under bf16, and Gemma's q/k norms keep 2 x (q_dim + kv_dim) more than Qwen3's, which _SAVED counts.
_SANDWICH = {"autocast": 16, "bf16": 20}
_SANDWICH_FAMILIES = ("gemma2", "gemma3", "gemma4", "vaultgemma")
# A MoE layer of transformers' experts, beyond its FFN's 8 x ffn per active expert, each active expert's copy
# of the token (2 x hidden) and the router's fp32 logits: measured on Mixtral and Qwen3-MoE layers (several
# hidden sizes, expert widths, expert and top-k counts; within 2%), autocast keeps another 8 x expert FFN and
# (6 x hidden) per active expert less 2 x hidden, bf16 another 2 x hidden per active expert.
_MOE_EXTRA = {"autocast": (8, 6, -2), "bf16": (0, 2, 0)}   # (x active x expert FFN, x active x hidden, x hidden)
# Llama 4's experts run densely (every expert on every token, one batched matmul each): fitted the same way, and
# its q/k norm (an L2 norm without weights) keeps 2 x (q_dim + kv_dim) less than the RMSNorm _SAVED counts.
_DENSE_MOE_EXTRA = {"autocast": (0, 4, 2), "bf16": (0, 2, 0)}
_DENSE_MOE_FAMILIES = ("llama4",)
# Outside the layers, per token: the final norm's input and output and the loss's bf16 input (autocast 12 x
# hidden, bf16 8 x hidden), the labels (int64) and the loss's log-sum-exp (fp32): 12 bytes.
_HEAD = {"autocast": 12, "bf16": 8}
_HEAD_BYTES = 12
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


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise CostModelError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def precision_for(num_gpus: int, sharding: str = DEFAULT) -> str:
    """The precision path the runtime takes (``flexsp.runtime.shard_model``): FSDP2's bf16 parameters when it
    wraps (more than one GPU, sharding other than "none"), else autocast."""
    return "bf16" if num_gpus > 1 and check(sharding) != "none" else "autocast"


def layer_activation_bytes(spec: Any, kind: Any, recompute: str | bool = "none", precision: str = "autocast") -> float:
    """Activation bytes one token keeps for backward in one layer of ``kind`` (a ``LayerKind``) of ``spec``.

    Softmax layers (full, window, chunk alike: the flash kernels save the same) follow ``_SAVED``. A MoE
    layer's FFN keeps, instead of the dense FFN's 8 bytes x ffn, 8 x (active experts x expert FFN + shared
    FFN), each active expert's copy of the token (2 x hidden) and the router's fp32 logits (4 x experts). A
    linear-attention layer keeps, instead of q/k/v, its projection outputs (q, k, v, z, b, a: 2 bytes each),
    the convolution outputs (q, k, v), the recurrence's output (fp32 before its gated norm, and bf16 after)
    and the chunked form's fp32 state per 64-token chunk. The MoE and linear figures are counts of what
    those layers are built to save; the MoE figures are measured on transformers' Mixtral and Qwen3-MoE layers
    (``_MOE_EXTRA``; Llama 4's dense experts ``_DENSE_MOE_EXTRA``), the linear ones not yet. Gemma's sandwich norms
    add ``_SANDWICH``."""
    recompute, precision = check_recompute(recompute), check_precision(precision)
    h, q, kv, f, heads = _SAVED[(spec.implementation, precision)][recompute]
    if recompute == "full":
        return float(h * spec.hidden)
    total = h * spec.hidden
    dense_moe = spec.family.startswith(_DENSE_MOE_FAMILIES)
    if spec.family.startswith(_SANDWICH_FAMILIES):
        total += _SANDWICH[precision] * spec.hidden + (2 * (spec.q_dim + spec.kv_dim) if spec.qk_norm else 0)
    if kind.moe:
        k = spec.active_experts
        per_ffn, per_copy, per_hidden = (_DENSE_MOE_EXTRA if dense_moe else _MOE_EXTRA)[precision]
        total += 8 * (k * spec.moe_ffn + spec.shared_ffn) + 2 * k * spec.hidden + 4 * spec.experts \
            + per_ffn * k * spec.moe_ffn + per_copy * k * spec.hidden + per_hidden * spec.hidden
    else:
        total += f * spec.ffn
    if kind.softmax:
        total += q * spec.q_dim + kv * spec.kv_dim + heads * spec.heads
        if spec.qk_norm:   # each per-head norm keeps its input and normalised output, and its rsqrt (fp32)
            total += (4 if dense_moe else 6) * (spec.q_dim + spec.kv_dim) \
                + 4 * (spec.heads + spec.kv_heads)
    else:
        shape = spec.linear_shape
        k, v = shape.key_width, shape.value_width
        chunk_state = 4 * shape.v_heads * shape.k_dim * shape.v_dim / shape.CHUNK
        total += 2 * (2 * k + 2 * v + 2 * shape.v_heads) + 2 * (2 * k + v) + (4 + 2) * v + chunk_state
    return float(total)


def activation_bytes_per_token(spec: Any, recompute: str | bool = "none", precision: str = "autocast") -> float:
    """Activation bytes one token keeps for backward over the whole model (``spec`` a ``ModelSpec``): the sum
    of ``layer_activation_bytes`` over its layers, and the final norm and loss's share."""
    precision = check_precision(precision)
    layers = sum(n * layer_activation_bytes(spec, kind, recompute, precision) for kind, n in spec.kind_counts().items())
    return layers + _HEAD[precision] * spec.hidden + _HEAD_BYTES


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
