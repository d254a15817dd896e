"""A cost model from a model and GPU description, for clusters nobody has profiled yet.

Formulas (bf16 training, fwd + bwd = 3x the forward FLOPs, FlashAttention so no s^2 memory):

Per layer kind (``ModelSpec.kinds``, ``flexsp.plan.layers``):

* ``alpha1 = 3 * full_layers * 2 * q_dim / (peak_flops * efficiency)`` seconds per token^2: causal
  attention does ``2 * s^2 * q_dim`` FLOPs per layer forward (QK^T and AV, half the square each;
  ``q_dim = heads x head size``). Windowed and chunked layers get the same rate per attention pair
  (``flexsp.plan.layers.pairs``: ``s^2`` below the window, ``~2 w s`` above it) in ``window_alpha[w]`` /
  ``chunk_alpha[c]``; linear-attention layers have no pair term.
* ``alpha2 = 3 * (2 * P_active + F_linear) / (peak_flops * efficiency)`` with ``P_active`` the weights
  every token multiplies (``ModelSpec.linear_params``: attention projections, the dense FFN or the router,
  active and shared experts of a MoE layer, the LM head) and ``F_linear`` the linear-attention
  recurrences' forward FLOPs per token (an estimate, ``LinearShape.mixing_flops_per_token``).
  Model states count every parameter (all experts): ``ModelSpec.params``.
* ``beta1``: a fixed per-group overhead (kernel launches, optimizer-free step bookkeeping), given.
* ``comm_bytes_per_token``: ``2 (fwd+bwd) * 2 bytes`` times, per softmax layer, ``2 q_dim + 2 kv_dim``
  (Ulysses moves Q, K, V in and the output back, K and V at their GQA width) and per linear-attention
  layer its convolution's input to the head layout and back, then its q, k, v and b/a gates in and its output
  back (``alltoall_elements``); ``alltoall_replication``: how much more moves at Ulysses degrees wider than
  the kv heads (or the linear layers' key heads), whose heads the runtime copies.
* Activation memory per token: ``flexsp.plan.memory.activation_bytes_per_token`` (what the layers save
  for backward, by precision path and recompute, measured against the real layers' saved tensors), on
  the precision path the runtime takes (``precision_for``: FSDP2 bf16 parameters when it wraps, autocast
  otherwise). Model states per GPU: ``flexsp.plan.memory.model_state_bytes`` (mixed-precision
  Adam as the runtime keeps it: ``"full"`` 16P/N, ``"grad_optim"`` 2P + 16P/N, ``"none"`` 18P).
  ``token_capacity = (memory * usable_fraction - model states) / activation bytes per token``.
* The Ulysses limit is the heads every mixer splits by (``ModelSpec.ulysses_heads``: the attention's and
  the linear layers' key and value heads).
* Beyond the Ulysses limit (``heads``), groups are Ulysses x ring hybrids (``flexsp.plan.cost``; none for a
  model with linear-attention layers, whose recurrences cannot run on a ring: ``model_axes``): the
  ring passes K and V (``2 * kv_dim * 2`` bytes per token per layer) three times per step (forward,
  and K/V plus their gradients backward) at the inter-node point-to-point bandwidth; each hop also
  costs ``inter_node_latency`` per softmax layer and pass (``ring_hop_latency = 3 * softmax layers * latency``; 5 us
  assumed, ``GPUSpec.inter_node_latency``).
* All-to-all bandwidth for every degree with a tile (``flexsp.plan.cluster.tileable_degrees``: inside
  a node, or whole nodes; non-powers of two included) and for the Ulysses part of each (``gcd(d, heads)``:
  8 of a 24-GPU group on 6-GPU nodes, which spans two nodes), per degree ``d`` (bytes of a rank's payload per second): each rank keeps
  ``1/d`` of its payload and sends the rest. Inside a node all of it crosses NVLink:
  ``bw[d] = intra_bw * d / (d - 1)``. Across nodes (``d > g``, ``g`` GPUs per node), the share
  ``(d - g) / d`` leaves the node over the GPU's NIC while ``(g - 1) / d`` stays on NVLink, and the
  slower of the two sets the pace: ``bw[d] = 1 / max((d - g) / (d * inter_bw), (g - 1) / (d * intra_bw))``.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import asdict, fields
from typing import Any, Iterable

from flexsp.errors import CostModelError
from flexsp.inputs import integer, number
from flexsp.plan.cluster import tileable_degrees, ulysses_split
from flexsp.plan.cost import CostModel
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import (activation_bytes_per_token, check_recompute, model_state_bytes, precision_for,
                                recompute_work, token_capacity)
from flexsp.plan.specs import GPUSpec, ModelSpec, get_gpu, get_model, model_names


def alltoall_bandwidth(degree: int, gpus_per_node: int, intra: float, inter: float) -> float:
    if degree <= gpus_per_node:
        return intra * degree / (degree - 1)
    off_node = (degree - gpus_per_node) / (degree * inter)
    on_node = (gpus_per_node - 1) / (degree * intra)
    return 1.0 / max(off_node, on_node)


def alltoall_elements(spec: ModelSpec, ulysses: int = 1) -> int:
    """Elements one token sends through a forward's all-to-alls at Ulysses degree ``ulysses``, every layer.

    A softmax-attention layer (full, window or chunk alike) moves Q and the output at ``q_dim`` width and K and V
    at ``kv_dim`` width, K and V copied ``u / gcd(kv_heads, u)`` times where the group is wider than the kv heads
    (every rank gets whole ones: ``flexsp.runtime.sp.ulysses``). A linear-attention layer runs two calls the
    runtime splits apart (``flexsp.hf.linear_attention``): the depthwise convolution takes its input (q, k at the
    key width, v at the value width) to the head layout and back, then the recurrence takes q, k (copied like kv
    heads), v and the gates b and a (one value per value head) there and sends its output (the value width) back;
    the z gate is applied after the output returns, so it stays put."""
    kv_copies = ulysses // math.gcd(spec.kv_heads, ulysses)
    kv = spec.kv_dim + spec.kv_heads * spec.v_head_size    # K and V on the wire (a latent v at its own width)
    total = spec.softmax_layers * (spec.q_dim + spec.heads * spec.v_head_size + kv_copies * kv)
    linear = spec.mixer_layers("linear")
    if linear:
        shape = spec.linear_shape
        k_copies = ulysses // math.gcd(shape.k_heads, ulysses)
        conv = 2 * shape.key_width + shape.value_width
        total += linear * (2 * conv + k_copies * 2 * shape.key_width + 2 * shape.value_width + 2 * shape.v_heads)
    return total


def comm_bytes_per_token(spec: ModelSpec, bytes_per_element: int = 2) -> float:
    """All-to-all bytes per token over a step (fwd + bwd, every layer) where no head is copied
    (``alltoall_elements``; ``alltoall_replication`` gives the degrees where some are)."""
    return 2 * alltoall_elements(spec) * bytes_per_element


def alltoall_replication(spec: ModelSpec, degrees: Iterable[int]) -> dict[int, float]:
    """``CostModel.alltoall_replication``: at the Ulysses part of each of ``degrees`` (``ulysses_split`` by the heads
    every layer splits by) where some layer copies heads, its all-to-all volume over ``comm_bytes_per_token``'s."""
    base = alltoall_elements(spec)
    parts = sorted({ulysses_split(int(d), spec.ulysses_heads)[0] for d in degrees} - {1})
    volumes = {u: alltoall_elements(spec, u) for u in parts}
    return {u: v / base for u, v in volumes.items() if v > base}


def model_axes(spec: ModelSpec, ring_bandwidth: float | None, hop_latency: float, bytes_per_element: int = 2
               ) -> dict[str, Any]:
    """The ``CostModel`` fields of ``spec``'s parallel axes: ``heads`` (those every mixer splits by, so the
    Ulysses limit), ``kv_heads``, and the ring axis at ``ring_bandwidth`` and ``hop_latency`` per message: K and V
    of the softmax layers, three passes a step. A model with linear-attention layers gets no ring axis: a
    recurrence cannot pass its state around a ring (``flexsp.runtime.sp.linear``), so degrees past its heads
    are not costed (not planned)."""
    heads = spec.ulysses_heads
    axes: dict[str, Any] = {"heads": heads, "kv_heads": math.gcd(spec.kv_heads, heads)}
    if spec.mixer_layers("linear") or ring_bandwidth is None:
        return {**axes, "ring_bytes_per_token": 0.0, "ring_bandwidth": None, "ring_hop_latency": 0.0}
    return {**axes, "ring_bytes_per_token": 3 * spec.softmax_layers * spec.ring_width * bytes_per_element,
            "ring_bandwidth": ring_bandwidth, "ring_hop_latency": 3 * spec.softmax_layers * hop_latency}


def attention_alphas(spec: ModelSpec, flops: float) -> tuple[float, dict[int, float], dict[int, float]]:
    """(alpha1, window_alpha, chunk_alpha): seconds per attention pair (``flexsp.plan.layers.pairs``) of the
    full, each window's and each chunk's layers: ``3 (fwd + bwd) x 2 q_dim`` FLOPs per pair and layer."""
    per_pair = 3 * 2 * spec.attention_width / flops
    windows: dict[int, float] = {}
    chunks: dict[int, float] = {}
    for kind, n in spec.kind_counts().items():
        table = {"window": windows, "chunk": chunks}.get(kind.mixer)
        if table is not None:
            table[kind.size] = table.get(kind.size, 0.0) + n * per_pair
    return spec.mixer_layers("full") * per_pair, windows, chunks


def alltoall_degrees(num_gpus: int, gpus_per_node: int, heads: int | None) -> list[int]:
    """The degrees an all-to-all table needs on this cluster: every degree > 1 a group may have (tiles: 3 and 6
    too) and their Ulysses parts (``ulysses_split``: a larger group runs Ulysses gcd(degree, heads) x ring)."""
    degrees = tileable_degrees(num_gpus, gpus_per_node)[1:]
    return sorted({*degrees, *(ulysses_split(d, heads)[0] for d in degrees)} - {1})


def analytic_cost_model(model: ModelSpec | str, gpu: GPUSpec | str, num_gpus: int, gpus_per_node: int = 8, *,
                        sharding: str = "full", beta1: float = 0.1, recompute: str | bool = "none") -> CostModel:
    """Cost model from FLOPs, bytes and bandwidths (formulas in the module docstring).

    ``sharding`` (``flexsp.plan.memory``: "full", "grad_optim", "none") sets the model states the
    capacity leaves room for; ``recompute`` ("none", "selective", "full"; the old bool means full/none)
    the activation bytes per token that capacity divides by and the extra forward work it costs."""
    sharding = check_sharding(sharding)
    recompute = check_recompute(recompute)
    model = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    for name in ("peak_flops", "memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth", "efficiency"):
        if not getattr(gpu, name) > 0:
            raise CostModelError(f"GPU {name} must be > 0, got {getattr(gpu, name)}")
    flops = gpu.peak_flops * gpu.efficiency
    precision = precision_for(num_gpus, sharding)
    act_per_token = activation_bytes_per_token(model, recompute, precision)
    attention_work, linear_work = recompute_work(recompute)
    capacity = token_capacity(gpu.memory_bytes, model_state_bytes(model.params, num_gpus, sharding), act_per_token,
                              usable_fraction=gpu.usable_memory,
                              what=f"{model.name} on {num_gpus} x {gpu.name} with sharding {sharding!r}:")
    heads = model.ulysses_heads
    degrees = alltoall_degrees(num_gpus, gpus_per_node, heads)
    alpha1, windows, chunks = attention_alphas(model, flops)
    return CostModel(
        alpha1=attention_work * alpha1,
        alpha2=linear_work * 3 * (2 * model.linear_params + model.mixing_flops_per_token()) / flops,
        beta1=beta1,
        comm_bytes_per_token=comm_bytes_per_token(model),
        alltoall_bandwidth={d: alltoall_bandwidth(d, gpus_per_node, gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)
                            for d in degrees},
        token_capacity=capacity,
        **model_axes(model, gpu.inter_node_bandwidth, gpu.inter_node_latency),
        alltoall_replication=alltoall_replication(model, degrees),
        window_alpha={w: attention_work * a for w, a in windows.items()},
        chunk_alpha={c: attention_work * a for c, a in chunks.items()},
        meta={"source": "analytic", "model": model.shape(), "gpu": asdict(gpu), "num_gpus": num_gpus,
              "gpus_per_node": gpus_per_node, "sharding": sharding, "recompute": recompute,
              "precision": precision, "activation_bytes_per_token": act_per_token},
    )


def cost_from_hardware(model: ModelSpec | str, gpu: GPUSpec | str, num_gpus: int, gpus_per_node: int = 8,
                       **options: Any) -> CostModel:
    """An analytic model of ``model`` (a registered name or ``ModelSpec``) on ``gpu`` (a name or ``GPUSpec``),
    every argument checked first (``options``: ``analytic_cost_model``'s keyword options)."""
    _check_spec(model, ModelSpec, model_names(), "model")
    _check_spec(gpu, GPUSpec, (), "gpu")
    num_gpus = integer(num_gpus, "num_gpus", CostModelError)
    gpus_per_node = integer(gpus_per_node, "gpus_per_node", CostModelError)
    allowed = [p.name for p in inspect.signature(analytic_cost_model).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise CostModelError(f"cost_from_hardware got unknown options {unknown}; valid: {', '.join(allowed)}")
    return analytic_cost_model(model, gpu, num_gpus=num_gpus, gpus_per_node=gpus_per_node, **options)


def _check_spec(value: Any, kind: type, known, what: str) -> None:
    """A model/GPU argument: a name (looked up later, with the list of known names) or a spec of numbers."""
    if isinstance(value, str):
        return
    if not isinstance(value, kind):
        raise CostModelError(f"{what} must be a registered name{' (' + ', '.join(known) + ')' if known else ''} "
                             f"or a {kind.__name__}, got {value!r}")
    for f in fields(value):
        if f.type not in ("float", float):
            continue
        number(getattr(value, f.name), f"{what} {f.name}", CostModelError, positive=True)
