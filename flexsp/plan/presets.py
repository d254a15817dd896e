"""The paper's published cost-model constants for GPT-7B/13B/30B on 64 x A100-40GB (docs/design.md, "Cost model").

Times were published in ms and memory in MB; we store seconds and bytes. Bandwidths are in the
reference's "MB per ms" (a time in ms is MB / v), so bytes/s = v * 2**20 * 1000. The memory model:
``token_capacity = floor((30 GB - model states) / activation MB per token)`` with model states from
``flexsp.plan.memory`` (default ``"full"``, ZeRO-3: ``params * 16 bytes / N``, the paper's setting).
Parameters were published at 192K and 384K context only; other contexts interpolate linearly between the two (labelled in ``meta``). The bandwidth table stops at 64 GPUs;
bigger clusters reuse the 64-GPU value for every larger degree (inter-node all-to-all bandwidth per
GPU flattens once most peers are off-node), also labelled in ``meta``.

The paper measured powers of two only. Every other degree with a tile (3, 5, 6, 7 inside its 8-GPU
nodes; 24, 40, 48, 56 on whole nodes) is interpolated between the nearest measured degrees on the same
side of the node boundary, with the time per byte ``1 / bw`` linear in ``1 / d`` (the shape of the
analytic model, ``flexsp.plan.analytic``: inside a node ``1/bw = (1 - 1/d) / intra``, across nodes
``(1 - g/d) / inter``), and flat beyond the last measured degree of its side; ``meta["bandwidth"]``
lists the interpolated degrees.

``cost_from_preset`` also serves the measured presets (``flexsp.plan.measured_presets``): cost models
``flexsp profile`` fitted on a real GPU, shipped as JSON in ``flexsp/plan/measured/`` with their
provenance, e.g. ``h200-llama3-8b``; and the analytic presets (``ANALYTIC_PRESETS``): models with layer
kinds and experts (GPT-OSS-20B, Gemma-3-27B, Qwen3.5-27B; ``flexsp.plan.specs``) costed by
``flexsp.plan.analytic`` on an assumed GPU, labelled ``meta["source"] == "analytic"``: nobody measured them.
``preset_names()`` lists every kind.
"""
from __future__ import annotations

from flexsp.errors import CostModelError
from flexsp.inputs import integer
from flexsp.plan.cluster import is_power_of_two, tileable_degrees
from flexsp.plan.cost import CostModel
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import model_state_bytes, token_capacity
from flexsp.plan.specs import get_model, model_names

MB = 2**20
MEMORY_LIMIT_MB = 30 * 1024
PAPER_BANDWIDTH_MB_PER_MS = {2: 119.54, 4: 104.07, 8: 96.5, 16: 10.33, 32: 5.94, 64: 4.87}


PAPER_GPUS_PER_NODE = 8
# Analytic presets: registered model -> the GPU its analytic cost model assumes (datasheet figures).
ANALYTIC_PRESETS = {"gpt-oss-20b": "h100-80gb", "gemma-3-27b": "h100-80gb", "qwen3.5-27b": "h100-80gb"}


def paper_bandwidth(num_gpus: int = 64, gpus_per_node: int = PAPER_GPUS_PER_NODE) -> dict[int, float]:
    """The paper's measured all-to-all bandwidth in bytes/s for degrees 2..64, extended to
    ``num_gpus`` with the 64-GPU value, plus every other degree with a tile on nodes of
    ``gpus_per_node`` GPUs, interpolated (``interpolate_bandwidth``)."""
    table = {d: v * MB * 1000 for d, v in PAPER_BANDWIDTH_MB_PER_MS.items()}
    degree = 128
    while degree <= num_gpus:
        table[degree] = table[64]
        degree *= 2
    measured = dict(table)
    for d in tileable_degrees(num_gpus, gpus_per_node)[1:]:
        if d not in measured:
            table[d] = interpolate_bandwidth(measured, d, PAPER_GPUS_PER_NODE)
    return dict(sorted(table.items()))


def interpolate_bandwidth(measured: dict[int, float], degree: int, gpus_per_node: int) -> float:
    """Bandwidth at ``degree`` from ``measured`` ones (degree -> bytes/s): ``1/bw`` linear in ``1/d``
    between the nearest measured degrees on the same side of the node boundary (inside a node of
    ``gpus_per_node``, or across nodes), flat beyond the last one of that side."""
    inside = degree <= gpus_per_node
    side = sorted(d for d in measured if d > 1 and (d <= gpus_per_node) == inside)
    if not side:
        raise CostModelError(f"no measured all-to-all bandwidth {'inside' if inside else 'across'} nodes to "
                             f"interpolate SP degree {degree} from")
    lower = [d for d in side if d < degree]
    upper = [d for d in side if d > degree]
    if not lower or not upper:
        return measured[(lower or upper)[-1 if lower else 0]]
    a, b = lower[-1], upper[0]
    w = (1 / a - 1 / degree) / (1 / a - 1 / b)
    return 1.0 / ((1 - w) / measured[a] + w / measured[b])


def preset_names() -> tuple[str, ...]:
    """Every preset ``cost_from_preset`` takes: the paper's, then the measured ones."""
    from flexsp.plan.measured_presets import measured_names   # here, so python -m flexsp.plan.measured_presets runs clean
    return (*model_names(paper=True), *measured_names(), *ANALYTIC_PRESETS)


def cost_from_preset(name: str, context: int = 384 * 1024, num_gpus: int = 64, *, sharding: str = "full",
                     gpus_per_node: int = PAPER_GPUS_PER_NODE) -> CostModel:
    """The cost model of preset ``name`` at ``context`` tokens, model states sharded ``sharding``
    (``flexsp.plan.memory``; the paper ran ZeRO-3, ``"full"``) over ``num_gpus`` GPUs; ``gpus_per_node``
    says which non-power-of-two degrees get an (interpolated) bandwidth. ``name`` is a paper preset
    (gpt-7b, gpt-13b, gpt-30b: the published A100 constants) or a measured one (``preset_names()``, e.g.
    h200-llama3-8b: measured compute and memory, provenance in ``meta["provenance"]``)."""
    from flexsp.plan.measured_presets import measured_cost_model, measured_names
    papers = model_names(paper=True)
    if isinstance(name, str) and name.lower() in measured_names():
        return measured_cost_model(name.lower(), context, num_gpus, sharding=sharding, gpus_per_node=gpus_per_node)
    if isinstance(name, str) and name.lower() in ANALYTIC_PRESETS:
        return _analytic_preset(name.lower(), context, num_gpus, sharding, gpus_per_node)
    if not isinstance(name, str) or name.lower() not in papers:
        raise CostModelError(f"unknown preset {name!r}; choose one of {sorted(preset_names())}")
    context = integer(context, "context (tokens, e.g. 393216; the CLI also reads 384K)", CostModelError)
    num_gpus = integer(num_gpus, "num_gpus", CostModelError)
    gpus_per_node = integer(gpus_per_node, "gpus_per_node", CostModelError)
    check_sharding(sharding)
    key = name.lower()
    spec = get_model(key)
    model = spec.paper
    states = model_state_bytes(model.params_b(context) * 2**30, num_gpus, sharding)   # the paper's B = 2**30
    capacity = token_capacity(MEMORY_LIMIT_MB * MB, states, model.act_mb_per_token * MB,   # bytes (MB = 2**20)
                              what=f"{name} on {num_gpus} GPUs with sharding {sharding!r} (30 GB each):")
    exact_params = context in (192 * 1024, 384 * 1024)
    return CostModel(
        alpha1=model.alpha1_ms / 1000,
        alpha2=model.alpha2_ms / 1000,
        beta1=model.beta1_ms / 1000,
        comm_bytes_per_token=4 * 2 * spec.layers * spec.hidden * 2,
        alltoall_bandwidth=(bandwidth := paper_bandwidth(num_gpus, gpus_per_node)),
        token_capacity=capacity,
        meta={"source": "FlexSP paper (arXiv 2412.01523), 64 x A100-40GB", "preset": key, "context": context,
              "num_gpus": num_gpus, "sharding": sharding, "params_b": round(model.params_b(context), 4),
              "activation_bytes_per_token": model.act_mb_per_token * MB,
              "params": "published" if exact_params else "interpolated between 192K and 384K",
              "bandwidth": ("published" if num_gpus <= 64 else "published to 64 GPUs, 64-GPU value above")
              + _interpolated(bandwidth)},
    )


def _analytic_preset(name: str, context: int, num_gpus: int, sharding: str, gpus_per_node: int) -> CostModel:
    """An analytic preset: ``flexsp.plan.analytic`` on ``ANALYTIC_PRESETS[name]``'s GPU (``context`` is
    recorded, not used: the analytic model has no context-dependent part)."""
    import dataclasses

    from flexsp.plan.analytic import cost_from_hardware
    context = integer(context, "context (tokens, e.g. 393216; the CLI also reads 384K)", CostModelError)
    cost = cost_from_hardware(name, ANALYTIC_PRESETS[name], num_gpus, gpus_per_node, sharding=sharding)
    return dataclasses.replace(cost, meta={**cost.meta, "preset": name, "context": context,
                                           "label": f"analytic: {name} on {ANALYTIC_PRESETS[name]} (datasheet "
                                                    f"FLOP/s and bandwidths, not measured)"})


def _interpolated(bandwidth: dict[int, float]) -> str:
    """The meta note on interpolated degrees (empty when there are none)."""
    others = [d for d in bandwidth if not is_power_of_two(d)]
    if not others:
        return ""
    shown = ", ".join(map(str, others[:8])) + (f", ... ({len(others)} degrees)" if len(others) > 8 else "")
    return f"; interpolated at non-power-of-two degrees {shown}"
