"""Interconnect presets: what a one-device profile cannot measure, taken from a documented figure and
marked as assumed. No torch.

One device measures compute and memory but no all-to-all, so its cost model would know no SP degree
above 1 and ``flexsp simulate`` could not use it. ``--interconnect NAME`` fills every degree it did not
measure from the preset below (``flexsp.plan.analytic.alltoall_bandwidth``: NVLink inside a node, the
GPU's share of the NICs across nodes), and the ring axis beyond the Ulysses limit (the model's heads)
from the inter-node figures unless the ring was measured (``flexsp.profile.ring``, under torchrun),
which is kept; ``meta["assumed"]`` names the preset, its figures and their sources, and
``meta["estimates"]`` lists the assumed parts, which ``flexsp simulate`` prints
(``flexsp.plan.cost.describe_sources``).

| preset | intra-node all-to-all | inter-node per GPU | per-message latency | source |
|---|---|---|---|---|
| ``nvlink-ib`` | 200 GB/s | 40 GB/s | 5 us | H100 SXM: NVLink 4 (900 GB/s per GPU, about 200 GB/s achieved by all-to-all in nccl-tests); one 400 Gb/s NDR ConnectX-7 per GPU (50 GB/s line rate, ~80% achieved); NCCL send/recv over IB with GPUDirect RDMA in the microseconds. The same constants as ``flexsp.plan.specs`` ``h100-80gb``. |
| ``a100-nvlink-ib`` | 90 GB/s | 6.25 GB/s | 5 us | A100 SXM: NVLink 3 (600 GB/s per GPU); 200 Gb/s HDR shared by 4 GPUs of a DGX-class node; the constants of ``flexsp.plan.specs`` ``a100-40gb``, close to the paper's measured table (its Table 2). |
| ``pcie`` | 16 GB/s | 1.25 GB/s | 20 us | PCIe Gen4 x16 (32 GB/s per direction line rate, about half achieved peer to peer through the host bridge); one 100 Gb/s Ethernet NIC (RoCE) shared by 8 GPUs; TCP/RoCE message latency in the tens of microseconds. |
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flexsp.errors import CostModelError
from flexsp.plan.analytic import alltoall_bandwidth, alltoall_replication, model_axes
from flexsp.plan.cost import CostModel
from flexsp.plan.specs import ModelSpec

ASSUMED_UP_TO = 16384   # largest degree an assumed interconnect fills (the planner's largest tested cluster)


@dataclass(frozen=True)
class Interconnect:
    name: str
    intra_node_bandwidth: float    # bytes/s per GPU that all-to-all achieves inside a node
    inter_node_bandwidth: float    # bytes/s per GPU across nodes (its share of the node's NICs)
    latency: float                 # seconds of one point-to-point message across nodes
    gpus_per_node: int
    source: str


INTERCONNECTS: dict[str, Interconnect] = {p.name: p for p in (
    Interconnect("nvlink-ib", 200e9, 40e9, 5e-6, 8,
                 "H100 SXM NVLink 4 (~200 GB/s all-to-all, nccl-tests); 400 Gb/s NDR per GPU (~40 GB/s); "
                 "5 us NCCL p2p over IB (flexsp.plan.specs h100-80gb)"),
    Interconnect("a100-nvlink-ib", 90e9, 6.25e9, 5e-6, 8,
                 "A100 SXM NVLink 3; 200 Gb/s HDR shared by 4 GPUs; 5 us NCCL p2p (flexsp.plan.specs a100-40gb, "
                 "close to the FlexSP paper's measured table)"),
    Interconnect("pcie", 16e9, 1.25e9, 20e-6, 8,
                 "PCIe Gen4 x16 peer to peer through the host (~16 GB/s); one 100 Gb/s Ethernet NIC (RoCE) shared by "
                 "8 GPUs; ~20 us message latency"),
)}


def get_interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise CostModelError(f"unknown interconnect {name!r}; choose one of {', '.join(INTERCONNECTS)} (or none)")
    return INTERCONNECTS[name]


def with_interconnect(cost: CostModel, spec: ModelSpec, name: str, bytes_per_element: int,
                      gpus_per_node: int | None = None, up_to: int = ASSUMED_UP_TO) -> CostModel:
    """``cost`` with every power-of-two degree up to ``up_to`` it has no measured bandwidth for filled
    from preset ``name``, the model's heads (Ulysses limit) and a ring axis at the inter-node figures
    beyond them; measured degrees, and a measured ring axis (``meta["ring"]["measured"]``), are kept.
    Everything filled is named in ``meta["assumed"]["parts"]``."""
    preset = get_interconnect(name)
    node = gpus_per_node or preset.gpus_per_node
    measured = dict(cost.alltoall_bandwidth)
    filled = {d: alltoall_bandwidth(d, node, preset.intra_node_bandwidth, preset.inter_node_bandwidth)
              for d in (2 ** i for i in range(1, up_to.bit_length())) if d <= up_to and d not in measured}
    ring_measured = bool((cost.meta.get("ring") or {}).get("measured")) and cost.ring_bandwidth is not None
    axes = model_axes(spec, preset.inter_node_bandwidth, preset.latency, bytes_per_element)
    if ring_measured:   # a measured ring axis (flexsp.profile.ring) is kept as it is
        axes = {k: axes[k] for k in ("heads", "kv_heads")}
    assumed: dict[str, Any] = {
        "interconnect": preset.name, "source": preset.source, "gpus_per_node": node,
        "figures": {"intra_node_bandwidth": preset.intra_node_bandwidth,
                    "inter_node_bandwidth": preset.inter_node_bandwidth, "latency": preset.latency},
        "degrees": sorted(filled), "parts": ["alltoall_bandwidth"] + ([] if ring_measured or axes.get("ring_bandwidth") is None
                                                                     else ["ring_bandwidth", "ring_hop_latency"])}
    meta = dict(cost.meta, assumed=assumed,
                estimates=sorted(set(cost.meta.get("estimates", [])) |
                                 {f"interconnect (assumed: --interconnect {preset.name} preset)"}))
    table = {**measured, **filled}
    return dataclasses.replace(cost, alltoall_bandwidth=table, meta=meta, **axes,
                               alltoall_replication=alltoall_replication(spec, table))


def preset_table() -> str:
    """One line per preset, for the CLI help."""
    return "; ".join(f"{p.name} ({p.intra_node_bandwidth / 1e9:g}/{p.inter_node_bandwidth / 1e9:g} GB/s, "
                     f"{p.latency * 1e6:g} us)" for p in INTERCONNECTS.values())
