"""Put the fitted pieces together into one ``flexsp.CostModel`` with its provenance. No torch.

``meta`` records where every number came from: the device, torch version, date, the model shape
(``meta["model"]``, which ``check_model_shape`` compares), how each part was obtained and which parts
are estimates, and the per-point fit errors, so a saved profile explains itself.

A ring fit (``flexsp.profile.ring``, one hop around the pool's rings) gives the ring axis:
``ring_bandwidth`` as fitted, and the fitted per-message latency times ``3 * layers`` as
``ring_hop_latency`` - the convention of ``flexsp.plan.analytic`` and the interconnect presets.

A per-kind fit (``flexsp.profile.kinds``) gives the layer-kind terms: ``alpha1`` the full layers' (and any
window or chunk whose kernel computes the whole masked matrix), ``window_alpha`` / ``chunk_alpha`` the others',
and ``meta["kinds"]`` records each kind's fit (work, coefficients per layer, errors, points).
"""
from __future__ import annotations

import datetime
from typing import Any, Mapping, Sequence

from flexsp.plan.analytic import alltoall_replication, comm_bytes_per_token, model_axes
from flexsp.plan.cost import CostModel
from flexsp.plan.specs import ModelSpec
from flexsp.profile.fit import BandwidthFit, ComputeFit, KindsModel


def assemble_cost_model(spec: ModelSpec, compute: ComputeFit, token_capacity: float, *,
                        bandwidths: Sequence[BandwidthFit] = (), bytes_per_element: int = 2,
                        gpus_per_node: int | None = None, memory: Mapping[str, Any] | None = None,
                        environment: Mapping[str, Any] | None = None,
                        estimates: Sequence[str] = (), ring: BandwidthFit | None = None,
                        ring_layout: Mapping[str, Any] | None = None, kinds: KindsModel | None = None) -> CostModel:
    """A cost model from the profiles; ``estimates`` names the parts that were not measured. ``ring``
    (a ``fit_bandwidth(..., what="ring")`` of one hop, ``ring_layout`` which ranks and link it ran on)
    adds the measured ring axis and the model's heads, so degrees beyond the Ulysses limit are costed.
    ``kinds`` (``fit.fit_kinds``: a layer of each kind fitted apart) gives ``window_alpha`` / ``chunk_alpha``
    and ``meta["kinds"]``, one record per kind; ``compute`` is then its ``total``."""
    estimates = list(estimates)
    terms: dict[str, Any] = {}
    if kinds is not None:       # a layer of each kind timed and fitted apart (flexsp.profile.kinds)
        terms = {"window_alpha": kinds.window_alpha, "chunk_alpha": kinds.chunk_alpha}
        estimates.extend(f"layer kind {k.name} ({k.layers} layers): {k.estimated}" for k in kinds.kinds if k.estimated)
    elif any(k.mixer != "full" for k in spec.kind_counts()):
        # timed as built and fitted as one alpha1 s^2 + alpha2 s model: no per-kind terms
        estimates.append("layer kinds: the compute fit treats every layer's attention as s^2 (per-kind terms, "
                         "window_alpha / chunk_alpha, are not fitted apart)")
    if any(k.moe for k in spec.kind_counts()):
        estimates.append("MoE layers: timed as the model builds them (TinyLM: a dense FFN of width ffn, no experts "
                         "or routing)")
    links = {}
    if gpus_per_node is not None:
        links = {str(b.degree): "intra-node" if b.degree <= gpus_per_node else "inter-node" for b in bandwidths}
    meta: dict[str, Any] = {
        "source": "flexsp profile",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **dict(environment or {}),
        "model": spec.shape(),
        "params": spec.params,
        "bytes_per_element": bytes_per_element,
        "estimates": sorted(set(estimates)),
        "compute": compute.to_dict(),
        "memory": dict(memory or {}),
        "sharding": dict(memory or {}).get("sharding", "full"),   # flexsp.plan.memory: what the capacity assumed
        "comm": {"gpus_per_node": gpus_per_node, "links": links,
                 "fits": {str(b.degree): b.to_dict() for b in bandwidths},
                 "comm_bytes_per_token": "2 * layers * (q, k, v and output widths) * bytes_per_element "
                                         "(flexsp.plan.analytic.comm_bytes_per_token, per layer kind)"},
    }
    if kinds is not None:
        meta["kinds"] = [k.to_dict() for k in kinds.kinds]
        meta["kinds_base"] = kinds.base.to_dict()     # the model without layers: embedding, LM head, loss
    axis = model_axes(spec, None, 0.0, bytes_per_element)   # the Ulysses limit the runtime has, ring or not
    if ring is not None:
        meta["ring"] = {"measured": True, **dict(ring_layout or {}), "fit": ring.to_dict(),
                        "ring_hop_latency": "3 * softmax layers * fitted latency",
                        "ring_bytes_per_token": "3 * softmax layers * (K + V width) * bytes_per_element"}
        # K and V cross the ring three times a step, per softmax layer: forward, and backward passes K/V again
        # and dK/dV back (flexsp.plan.analytic.model_axes); each hop of each pass pays the latency once. A model
        # with linear-attention layers gets no ring axis (its recurrences cannot run on a ring).
        axis = model_axes(spec, ring.bandwidth, ring.latency, bytes_per_element)
    return CostModel(alpha1=compute.alpha1, alpha2=compute.alpha2, beta1=compute.beta1,
                     comm_bytes_per_token=comm_bytes_per_token(spec, bytes_per_element),
                     alltoall_bandwidth={b.degree: b.bandwidth for b in bandwidths},
                     alltoall_replication=alltoall_replication(spec, [b.degree for b in bandwidths]),
                     token_capacity=token_capacity, meta=meta, **axis, **terms)
