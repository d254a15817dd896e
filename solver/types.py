"""The solver's shared types, in one module every solver step imports (and nothing else in ``solver``).

Costs: per-degree time and memory coefficients, the only view of the cost model the solver sees.
A sequence of ``s`` tokens in an SP group of degree ``d`` takes
``lin[d] * s + max(quad[d] * s**2, ring[d] * s)`` seconds: attention (``quad``) overlaps the
point-to-point KV passing of a ring axis (``ring``, zero for pure Ulysses groups). A group takes
the sum over its sequences plus ``beta1``; a group of degree ``d`` holds at most ``capacity[d]``
tokens. Any model of that shape plugs in (the paper's alpha-beta model, an analytic one, a
profiled one, a Ulysses x ring hybrid) without the solver knowing which.

Placement: for degrees whose tiles nest (powers of two on power-of-two nodes), a micro-batch whose
degrees sum to at most N always gets ranks. For other sets (3 and 2 in a node of 8, 16 and 24 on
8-GPU nodes) it may not, so ``DegreeCosts.placeable`` (given by the planner) says whether one
micro-batch's group counts per degree place, and ``tiles`` how many groups of each degree fit at most.

Schedules: what the solver returns, micro-batches of (degree, sequence ids) groups with no ranks
attached (``flexsp.plan.planner.place`` gives them ranks).

Errors: ``Infeasible`` (the batch cannot be planned on this cluster) and ``InfeasibleDegree`` (a
sequence does not fit one group of the degree a baseline insists on).
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import Callable, NamedTuple

import numpy as np


def seconds(s, quad, lin, ring=0.0, hops=0.0):
    """The one time formula, vectorised: ``lin*s + max(quad*s^2, ring*s + hops)``: attention overlapped
    with the ring's K/V passing, whose time is a bandwidth term per token plus ``hops``, the per-hop
    latency of one sequence's ring steps (0 without a ring axis)."""
    s = np.asarray(s, dtype=np.float64)
    return lin * s + np.maximum(quad * s * s, ring * s + hops)


@dataclass(frozen=True)
class DegreeCosts:
    degrees: tuple[int, ...]        # ascending SP degrees (powers of two by default; any with a tile)
    quad: tuple[float, ...]         # seconds per token^2, per degree
    lin: tuple[float, ...]          # seconds per token, per degree
    capacity: tuple[float, ...]     # tokens one group of this degree can hold
    beta1: float                    # seconds per group per micro-batch
    ring: tuple[float, ...] = ()    # seconds per token of ring KV passing (empty: no ring axis)
    hops: tuple[float, ...] = ()    # seconds of ring per-hop latency per sequence (empty: none)
    tiles: tuple[int, ...] = ()     # most groups of each degree one micro-batch holds (empty: N // degree)
    # whether a micro-batch with these group counts per degree index gets ranks; None: whenever the
    # degrees sum to at most N (the degrees nest). Not compared: two costs differ only in numbers.
    placeable: Callable[[np.ndarray], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = len(self.degrees)
        for name in ("ring", "hops"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * n)
        if self.tiles and len(self.tiles) != n:
            raise ValueError("DegreeCosts.tiles needs one entry per degree (or none)")
        if n == 0 or not (len(self.quad) == len(self.lin) == len(self.capacity) == len(self.ring) == len(self.hops) == n):
            raise ValueError("DegreeCosts needs one quad, lin, ring, hops and capacity entry per degree")
        if list(self.degrees) != sorted(set(self.degrees)):
            raise ValueError(f"degrees must be strictly ascending, got {self.degrees}")
        for name in ("quad", "lin", "ring", "hops"):
            object.__setattr__(self, f"_{name}", np.asarray(getattr(self, name), dtype=np.float64))

    def seconds(self, lengths, k) -> np.ndarray:
        """Seconds of sequences at degree index ``k`` (an int or an array broadcast with ``lengths``)."""
        return seconds(lengths, self._quad[k], self._lin[k], self._ring[k], self._hops[k])

    def max_groups(self, k: int, num_gpus: int) -> int:
        """Most groups of degree index ``k`` one micro-batch of ``num_gpus`` GPUs can hold."""
        return int(self.tiles[k]) if self.tiles else num_gpus // self.degrees[k]

    @property
    def num_degrees(self) -> int:
        return len(self.degrees)

    def index(self, degree: int) -> int:
        return self.degrees.index(degree)

    def places(self, per_degree: np.ndarray) -> bool:
        """Whether a micro-batch with ``per_degree`` groups of each degree index gets ranks: always where the
        degrees nest (``placeable`` None; the caller keeps GPUs within N), else ``placeable``'s answer."""
        return self.placeable is None or bool(self.placeable(per_degree))

    def all_seconds(self, lengths: np.ndarray) -> np.ndarray:
        """``[len(lengths), num_degrees]`` seconds, memory aside: one call for every degree."""
        return self.seconds(np.asarray(lengths, dtype=np.float64)[:, None], np.arange(self.num_degrees)[None, :])

    def times(self, lengths: np.ndarray, all_seconds: np.ndarray | None = None) -> np.ndarray:
        """``[len(lengths), num_degrees]`` seconds; ``inf`` where one sequence alone overflows memory.
        ``all_seconds``: ``all_seconds(lengths)``, if the caller has it (not changed)."""
        s = np.asarray(lengths, dtype=np.float64)[:, None]
        out = self.all_seconds(lengths) if all_seconds is None else all_seconds.copy()
        out[s > np.asarray(self.capacity)[None, :]] = np.inf
        return out

    def seq_time(self, lengths: np.ndarray, k: int) -> np.ndarray:
        return self.seconds(lengths, k)

    def group_time(self, lengths: np.ndarray, k: int) -> float:
        return float(self.seq_time(lengths, k).sum()) + self.beta1


# --- schedules ---------------------------------------------------------------------------
class GroupAssignment(NamedTuple):
    """One group of a micro-batch. Immutable like the frozen dataclasses elsewhere, but a named
    tuple: a 16,384-GPU plan builds millions of these while searching, and a tuple is built ~4x
    faster than a frozen dataclass."""

    degree: int
    seq_ids: np.ndarray  # int64 indices into the batch's lengths

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return costs.group_time(lengths[self.seq_ids], costs.index(self.degree))



assignment = partial(tuple.__new__, GroupAssignment)     # a GroupAssignment from a (degree, seq_ids) pair, no keywords


class LazyItems(Sequence):
    """A sequence whose items ``_build`` makes on first access, once: callers that read only the columns
    behind it (a subclass's arrays) never pay for one object per item."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: Sequence | None = None

    @abstractmethod
    def _build(self) -> Sequence:
        """The items, from the subclass's columns."""

    def built(self) -> Sequence:
        """The items, made now if not yet."""
        if self._items is None:
            self._items = self._build()
        return self._items

    def __getitem__(self, i):
        return self.built()[i]

    def __iter__(self):
        return iter(self.built())


class Groups(LazyItems):
    """Each group's ids as one flat array cut by ``sizes``, split into per-group arrays only when a
    group is first asked for: a caller comparing packings by their loads (``refine``) never pays for
    the thousands of slices of the packing it drops."""

    __slots__ = ("flat", "sizes")

    def __init__(self, flat: np.ndarray, sizes: np.ndarray):
        super().__init__()
        self.flat, self.sizes = flat, np.asarray(sizes, dtype=np.int64)

    def _build(self) -> list[np.ndarray]:
        return split_at(self.flat, self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def nonempty(self) -> tuple["Groups", np.ndarray]:
        """The groups that hold a sequence, and their positions."""
        used = np.flatnonzero(self.sizes)
        return (self, used) if used.size == len(self.sizes) else (Groups(self.flat, self.sizes[used]), used)


def flat_ids(members) -> np.ndarray:
    """All ids of ``members`` (a list of arrays or ``Groups``) in group order."""
    return members.flat if isinstance(members, Groups) else np.concatenate(members)


def split_at(values: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    """``values`` cut into consecutive pieces of ``sizes`` (``np.split`` without its per-piece
    overhead, which dominates with tens of thousands of groups)."""
    ends = np.cumsum(sizes).tolist()
    starts = [0] + ends[:-1]
    return [values[a:b] for a, b in zip(starts, ends)]



class GroupColumns(LazyItems):
    """One micro-batch's groups as columns: each group's degree, and all their ids as ``Groups`` (one flat
    array cut by sizes). It reads as a tuple of ``GroupAssignment`` (built on first access, once), so any
    caller works on it; the planner's own steps (placing, timing, renumbering a part's ids) read the columns,
    and a 16,384-GPU plan's 131,072 groups are not built twice on the way to its ``Plan``."""

    __slots__ = ("degrees", "ids")

    def __init__(self, degrees: np.ndarray, ids: "Groups"):
        super().__init__()
        self.degrees, self.ids = np.asarray(degrees, dtype=np.int64), ids

    @classmethod
    def of(cls, members, degree_idx: np.ndarray, costs: "DegreeCosts") -> "GroupColumns":
        """Columns of groups given as ids (a list of arrays or ``Groups``) and degree indices."""
        ids = members if isinstance(members, Groups) else Groups(
            flat_ids(members) if len(members) else np.zeros(0, dtype=np.int64), group_sizes(members))
        return cls(np.asarray(costs.degrees, dtype=np.int64)[np.asarray(degree_idx, dtype=np.int64)], ids)

    def _build(self) -> tuple[GroupAssignment, ...]:
        return tuple(map(assignment, zip(self.degrees.tolist(), self.ids)))

    def __len__(self) -> int:
        return len(self.degrees)


def group_sizes(members) -> np.ndarray:
    """How many ids each group of ``members`` (a list of arrays or ``Groups``) holds."""
    return members.sizes if isinstance(members, Groups) else np.fromiter(map(len, members), dtype=np.int64,
                                                                           count=len(members))


def group_loads(members, degree_idx: np.ndarray, lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    """Seconds of sequences in each group of ``members`` (a list of arrays or ``Groups``; no beta1);
    ``degree_idx`` indexes ``costs.degrees``. Vectorised over all sequences at once."""
    owner = np.repeat(np.arange(len(members)), group_sizes(members))
    per_seq = costs.seconds(lengths[flat_ids(members)], np.asarray(degree_idx)[owner])
    return np.bincount(owner, weights=per_seq, minlength=len(members))


def group_times(groups: tuple[GroupAssignment, ...], lengths: np.ndarray, costs: DegreeCosts) -> np.ndarray:
    """Seconds of every group of a micro-batch, beta1 included."""
    degree_idx = [costs.index(g.degree) for g in groups]
    return group_loads([g.seq_ids for g in groups], degree_idx, lengths, costs) + costs.beta1


_degree, _seq_ids = attrgetter("degree"), attrgetter("seq_ids")


@dataclass(frozen=True)
class Schedule:
    """Micro-batches run one after another; the groups of one micro-batch run side by side.
    ``cut_short``: the search that made it stopped at a wall-clock deadline (its plan may depend on the
    machine's speed); not compared."""

    micro_batches: tuple[tuple[GroupAssignment, ...], ...]
    cut_short: bool = field(default=False, compare=False)

    def micro_batch_times(self, lengths: np.ndarray, costs: DegreeCosts) -> list[float]:
        """Slowest group of each micro-batch; one vectorised pass over every group of the plan."""
        if self.micro_batches and all(isinstance(mb, GroupColumns) for mb in self.micro_batches):
            columns = self.micro_batches                  # the same loads, read off the columns
            ids = Groups(np.concatenate([mb.ids.flat for mb in columns]), np.concatenate([mb.ids.sizes for mb in columns]))
            degree_idx = np.searchsorted(np.asarray(costs.degrees), np.concatenate([mb.degrees for mb in columns]))
            loads = group_loads(ids, degree_idx, lengths, costs) + costs.beta1
        else:
            groups = [g for mb in self.micro_batches for g in mb]
            if not groups:
                return []
            index = {d: k for k, d in enumerate(costs.degrees)}
            degree_idx = np.fromiter(map(index.__getitem__, map(_degree, groups)), dtype=np.int64, count=len(groups))
            loads = group_loads(list(map(_seq_ids, groups)), degree_idx, lengths, costs) + costs.beta1
        owner = np.repeat(np.arange(len(self.micro_batches)), [len(mb) for mb in self.micro_batches])
        slowest = np.full(len(self.micro_batches), -np.inf)
        np.maximum.at(slowest, owner, loads)
        return slowest.tolist()

    def time(self, lengths: np.ndarray, costs: DegreeCosts) -> float:
        return float(sum(self.micro_batch_times(lengths, costs)))

    def places(self, costs: DegreeCosts) -> bool:
        """Whether every micro-batch gets ranks (``DegreeCosts.places``). The search's own plans do (the packer
        and ``tighten`` check as they go); another strategy's, the MILP's or the subset DP's may not."""
        if costs.placeable is None:
            return True
        index = {d: k for k, d in enumerate(costs.degrees)}
        for groups in self.micro_batches:
            got = groups.degrees.tolist() if isinstance(groups, GroupColumns) else [g.degree for g in groups]
            if not costs.places(np.bincount([index[d] for d in got], minlength=len(costs.degrees))):
                return False
        return True

    @property
    def num_sequences(self) -> int:
        return sum(len(g.seq_ids) for mb in self.micro_batches for g in mb)

    def degree_of_sequences(self, n: int) -> np.ndarray:
        """The SP degree each of ``n`` sequences runs at (0 for one the schedule leaves out)."""
        out = np.zeros(n, dtype=np.int64)
        for mb in self.micro_batches:
            for g in mb:
                out[g.seq_ids] = g.degree
        return out


# --- errors ------------------------------------------------------------------------------
class Infeasible(ValueError):
    """The batch cannot be planned on this cluster (a sequence longer than all GPUs can hold)."""


class InfeasibleDegree(ValueError):
    """A sequence is longer than one group of this degree can hold."""
