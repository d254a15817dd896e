"""Memory the SP communicators take, and the token capacity left for activations once it is paid.

A ``GroupPool`` gives every rank at most one communicator per SP degree above 1 it holds: a degree's
groups sit on its tiles (``flexsp.plan.cluster``: inside a node or whole nodes, one fixed tiling per
degree, powers of two included), so each rank is in at most one of them; degree 1 needs none. A
Ulysses x ring degree (``ulysses_split``: Ulysses over ``gcd(d, heads)`` ranks, a ring over the rest)
adds one ring communicator, and one Ulysses sub-group communicator (consecutive blocks of ``u`` ranks,
the same blocks for every degree with that ``u``) unless those blocks are tiles of a pooled degree
``u``. The bound per rank is therefore
``#{pooled d > 1} + #{hybrid splits} + #{distinct Ulysses sizes u > 1 of hybrid splits whose blocks are not pooled tiles}``,
at most three per pooled degree, whatever the plans (``communicators_per_rank``). NCCL allocates
buffers per communicator, and the total grows with the count: NVIDIA/nccl#964 measured 544 MB for
a 2-GPU and 688 MB for a 4-GPU communicator on 4 x A100 (NVLink) after one all-reduce, and
NVIDIA/nccl#2363 reports a 512 MiB shared network buffer per communicator (NCCL 2.28). The default
below, ``COMMUNICATOR_BYTES`` = 512 MiB, sits in that range; it is a documented figure, not a
measurement of your cluster: override it with what ``torch.cuda.mem_get_info`` shows before and
after building your pool (NCCL_BUFFSIZE and the channel count change it).

Planning with ``reserve_communicators(cost, pool_degrees)`` lowers ``token_capacity`` by
``communicators x bytes_each / activation_bytes_per_token`` (rounded down to whole tokens), so a
plan never counts on memory the communicators hold. Fewer degrees (``plan_batch(degrees=...)``,
``GroupPool(degrees=...)``) mean fewer communicators and more tokens per GPU.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from flexsp.errors import CostModelError
from flexsp.inputs import number
from flexsp.plan.cluster import Cluster, ulysses_split
from flexsp.plan.cost import CostModel

COMMUNICATOR_BYTES = 512 * 2**20


def communicators_per_rank(degrees: Iterable[int], heads: int | None = None, gpus_per_node: int | None = None) -> int:
    """Most communicators a rank holds in a pool of these SP degrees (the bound of the module
    docstring): one per degree above 1, plus, for a model with ``heads`` query heads, one ring per
    Ulysses x ring degree and one Ulysses sub-group per distinct Ulysses size ``u`` whose blocks are not
    tiles of a pooled degree (they are when ``u`` is pooled and divides the node size or is whole nodes;
    ``gpus_per_node`` None: assume they are)."""
    pooled = {int(d) for d in degrees if int(d) > 1}
    hybrid = {(d, *ulysses_split(d, heads)) for d in pooled}
    hybrid = {(d, u) for d, u, r in hybrid if u > 1 and r > 1}     # u == 1: the ring is the group itself

    def reused(d: int, u: int) -> bool:
        if u not in pooled:
            return False
        g = gpus_per_node
        return g is None or d <= g or (g % u == 0 if u <= g else u % g == 0)
    def family(d: int, u: int):      # blocks of u from each node's start, or from rank 0 (the same when u | g)
        g = gpus_per_node
        return u if g is None or g % u == 0 or u % g == 0 else (u, d <= g)
    return len(pooled) + len(hybrid) + len({family(d, u) for d, u in hybrid if not reused(d, u)})


def pool_degrees(cluster: Cluster, strategy: str = "flexsp", degrees: Iterable[int] | str | None = None,
                 sp_degree: int | None = None, cost: CostModel | None = None) -> tuple[int, ...]:
    """The degrees a pool must hold to run every plan of ``strategy`` (what ``plan_batch`` may use);
    ``degrees="any"`` needs ``cost`` (every degree with a tile it can cost). With ``cost``, the default degrees are
    the ones ``plan_batch`` would use: none that needs a ring axis the model lacks (linear attention)."""
    if isinstance(degrees, str) and cost is None:
        raise CostModelError(f"degrees={degrees!r} needs the cost model to say which degrees it can cost")
    if cost is not None and (degrees is None or isinstance(degrees, str)):
        from flexsp.plan.config import PlanConfig   # the config imports the strategies: only when asked
        degrees = PlanConfig(degrees=degrees).checked(cost, cluster).degrees
    usable = tuple(sorted(set(degrees))) if degrees is not None else cluster.degrees
    from flexsp.plan.strategies import get_strategy  # the registry imports the solver: only when asked
    if get_strategy(strategy).accepts_sp_degree:    # one degree for every group
        return (sp_degree if sp_degree is not None else usable[-1],)
    return usable


def reserve_communicators(cost: CostModel, degrees: Iterable[int], bytes_each: float = COMMUNICATOR_BYTES, *,
                          activation_bytes_per_token: float | None = None, gpus_per_node: int | None = None) -> CostModel:
    """``cost`` with ``token_capacity`` lowered by the memory of a pool of ``degrees``' communicators.

    The count is ``communicators_per_rank(degrees, cost.heads, gpus_per_node)`` (hybrid sub-groups included).
    ``activation_bytes_per_token`` defaults to what the cost model records (presets, analytic models
    and profiles do). Applying it again replaces the earlier reservation rather than adding to it.
    ``meta["communicators"]`` records the count, bytes each, tokens given up and the capacity before.
    """
    bytes_each = number(bytes_each, "bytes per communicator", CostModelError)
    per_token = activation_bytes_per_token if activation_bytes_per_token is not None else cost.activation_bytes_per_token
    if per_token is None:
        raise CostModelError("this cost model does not record its activation bytes per token (meta "
                             "'activation_bytes_per_token'); pass activation_bytes_per_token=... to reserve "
                             "communicator memory")
    per_token = number(per_token, "activation_bytes_per_token", CostModelError, positive=True)
    count = communicators_per_rank(degrees, cost.heads, gpus_per_node)
    before = _capacity_before(cost)
    reserved = count * bytes_each / per_token
    capacity = math.floor(before - reserved)
    if capacity < 1:
        raise CostModelError(
            f"{count} communicators x {bytes_each / 2**20:.0f} MiB per rank leave no activation memory "
            f"(they take {reserved:.0f} of {before:.0f} tokens per GPU); use fewer SP degrees or a smaller figure")
    meta = dict(cost.meta, communicators={"count": count, "bytes_each": bytes_each, "tokens": math.ceil(reserved),
                                          "capacity_before": before})
    return dataclasses.replace(cost, token_capacity=capacity, meta=meta)


def _capacity_before(cost: CostModel) -> float:
    """The capacity an earlier reservation (``meta["communicators"]``) started from, so a new one replaces it;
    ``token_capacity`` when there is none. ``meta`` comes from a file: its figure counts only where it is a number
    that reservation can have lowered to ``token_capacity`` (at most its tokens above it), so no file raises the
    capacity past what its coefficient says."""
    previous = cost.meta.get("communicators")
    if not isinstance(previous, Mapping):
        return cost.token_capacity
    before, tokens = previous.get("capacity_before"), previous.get("tokens")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (before, tokens))
    if numbers and cost.token_capacity <= before <= cost.token_capacity + tokens + 1:
        return float(before)
    return cost.token_capacity


def describe_reservation(cost: CostModel, label: str = "") -> str:
    """One line: communicators per rank, their memory, the capacity before and after."""
    info = cost.meta.get("communicators")
    if not isinstance(info, Mapping) or not {"count", "bytes_each", "capacity_before"} <= set(info):
        return f"{label}no communicator memory reserved; token capacity {cost.token_capacity:.0f} per GPU"
    total = info["count"] * info["bytes_each"]
    plural = "" if info["count"] == 1 else "s"
    return (f"{label}{info['count']} communicator{plural} per rank x {info['bytes_each'] / 2**20:.0f} MiB = "
            f"{total / 2**30:.2f} GiB reserved: token capacity {info['capacity_before']:.0f} -> "
            f"{cost.token_capacity:.0f} per GPU")
