"""The GPU topology a plan is made for: how many GPUs and how they are grouped into nodes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from flexsp.errors import ClusterError, PlanError
from flexsp.inputs import integer

MAX_GPUS = 2**40    # far above any cluster; keeps every per-rank array the planner builds small


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0


def power_of_two_degrees(num_gpus: int) -> tuple[int, ...]:
    """Every power-of-two SP degree up to ``num_gpus``, ascending: the one list of degrees a world allows."""
    return tuple(1 << i for i in range(int(num_gpus).bit_length()))


# --- the aligned-block rule: the one place that says which ranks an SP group of degree d may use ---
def aligned_block(index: int, degree: int) -> tuple[int, ...]:
    """Ranks of the ``index``-th aligned block of ``degree``: ``[index*degree, (index+1)*degree)``.

    Aligned blocks of power-of-two degrees nest, so a group of at most a node's GPUs never spans
    nodes, and the runtime can pre-create every group a plan may ask for."""
    return tuple(range(index * degree, (index + 1) * degree))


# --- tiles: the placement rule for SP groups of any degree (non-power-of-two included) ---
# A degree d has one fixed tiling of the ranks: inside a node when d <= the node size (node n holds
# tiles n*g + k*d for k < g // d; the g % d ranks left over are not in any tile of d), or whole nodes
# when d is a multiple of the node size (tiles k*d across the cluster). A group of degree d always
# sits on one tile of d, so each rank holds at most one communicator per degree > 1, whatever the
# plans; for power-of-two degrees on power-of-two nodes the tiles are the aligned blocks above.
def node_size(num_gpus: int, gpus_per_node: int) -> int:
    """GPUs in one node of this cluster (a single partial node is the whole cluster)."""
    return min(int(gpus_per_node), int(num_gpus))


def tileable(degree: int, num_gpus: int, gpus_per_node: int) -> bool:
    """Whether a group of ``degree`` GPUs has a tile: inside a node, or a whole number of nodes."""
    g = node_size(num_gpus, gpus_per_node)
    return 1 <= degree <= num_gpus and (degree <= g or degree % g == 0)


def tile_starts(degree: int, num_gpus: int, gpus_per_node: int) -> np.ndarray:
    """First rank of every tile of ``degree``, ascending (empty when the degree has no tile)."""
    if not tileable(degree, num_gpus, gpus_per_node):
        return np.zeros(0, dtype=np.int64)
    g = node_size(num_gpus, gpus_per_node)
    if degree <= g:
        per_node = np.arange(g // degree, dtype=np.int64) * degree
        return (np.arange(num_gpus // g, dtype=np.int64)[:, None] * g + per_node[None, :]).ravel()
    return np.arange(num_gpus // degree, dtype=np.int64) * degree


def is_tile_start(first: np.ndarray, degree: np.ndarray, num_gpus: int, gpus_per_node: int) -> np.ndarray:
    """Vectorised: whether a group of ``degree`` GPUs starting at rank ``first`` lies on a tile."""
    first, degree = np.asarray(first, dtype=np.int64), np.asarray(degree, dtype=np.int64)
    g = node_size(num_gpus, gpus_per_node)
    inside = first % g
    in_node = (degree <= g) & (inside % np.maximum(degree, 1) == 0) & (inside + degree <= g)
    whole = (degree > g) & (degree % g == 0) & (first % np.maximum(degree, 1) == 0)
    return (in_node | whole) & (degree >= 1) & (first >= 0) & (first + degree <= num_gpus)


def nests(degrees: Iterable[int], num_gpus: int, gpus_per_node: int) -> bool:
    """Whether ``degrees`` form a chain whose tiles nest (each degree divides the next, and every
    degree inside a node divides the node size). Then ``place_groups`` succeeds whenever the degrees
    of a micro-batch sum to at most ``num_gpus``: largest first, each group's start is a multiple of
    its degree that no tile boundary of a larger degree cuts. Powers of two on power-of-two nodes nest."""
    chain = sorted(set(int(d) for d in degrees))
    g = node_size(num_gpus, gpus_per_node)
    return (all(tileable(d, num_gpus, gpus_per_node) for d in chain)
            and all(b % a == 0 for a, b in zip(chain, chain[1:]))
            and all(g % d == 0 for d in chain if d <= g))


def _place(counts: Mapping[int, int], num_gpus: int, gpus_per_node: int, partial: bool) -> dict[int, np.ndarray] | None:
    """First ranks of the tiles chosen for ``counts[d]`` groups of each degree ``d``: largest degree
    first, each on the lowest free tile of its degree, vectorised over nodes. ``partial``: place as
    many of each degree as have a free tile (possibly fewer); else None when one does not fit."""
    g = node_size(num_gpus, gpus_per_node)
    nodes = num_gpus // g
    free = np.ones((nodes, g), dtype=bool)              # [node, local rank]
    out: dict[int, np.ndarray] = {}
    for d in sorted((d for d, c in counts.items() if c > 0), reverse=True):
        want = int(counts[d])
        if not tileable(d, num_gpus, gpus_per_node):
            if not partial:
                return None
            out[d] = np.zeros(0, dtype=np.int64)
            continue
        if d <= g:
            per = g // d
            tiles = free[:, :per * d].reshape(nodes, per, d).all(axis=2).ravel()     # node-major, tile-minor
            chosen = np.flatnonzero(tiles)[:want]
            node, k = np.divmod(chosen, per)
            free[node[:, None], (k * d)[:, None] + np.arange(d)[None, :]] = False
            starts = node * g + k * d
        else:
            m = d // g
            blocks = free.all(axis=1)[:(nodes // m) * m].reshape(-1, m).all(axis=1)
            chosen = np.flatnonzero(blocks)[:want]
            free[(chosen[:, None] * m + np.arange(m)[None, :]).ravel()] = False
            starts = chosen * d
        if len(chosen) < want and not partial:
            return None
        out[d] = starts.astype(np.int64)
    return out


def place_groups(degrees: Sequence[int], num_gpus: int, gpus_per_node: int) -> np.ndarray | None:
    """First rank of each group's tile (in the order given), or None when they do not all fit.

    Largest degree first, each group on the lowest free tile of its degree; groups of one degree are
    placed together, vectorised over nodes, so the cost grows with distinct degrees and nodes, not
    with groups. Always succeeds for degrees that ``nests`` accepts and that sum to at most N; for other
    sets it may fail although the degrees sum to at most N (planners check it)."""
    degrees = np.asarray(degrees, dtype=np.int64)
    if len(degrees) == 0:
        return np.zeros(0, dtype=np.int64)
    if (degrees < 1).any() or int(degrees.sum()) > num_gpus:
        return None
    values, counts = np.unique(degrees, return_counts=True)
    chosen = _place(dict(zip(values.tolist(), counts.tolist())), num_gpus, gpus_per_node, partial=False)
    if chosen is None:
        return None
    starts = np.empty(len(degrees), dtype=np.int64)
    for d, first in chosen.items():
        starts[degrees == d] = first                    # groups of one degree, in the order given
    return starts


def places(counts: Mapping[int, int], num_gpus: int, gpus_per_node: int) -> bool:
    """Whether ``counts[d]`` groups of each degree ``d`` get ranks together: ``place_groups`` on the
    counts, without building one entry per group (the solver asks this of every packing it tries)."""
    counts = {int(d): int(c) for d, c in counts.items() if c > 0}
    if any(d < 1 for d in counts) or sum(d * c for d, c in counts.items()) > num_gpus:
        return False
    return _place(counts, num_gpus, gpus_per_node, partial=False) is not None


def place_partial(degrees: Sequence[int], num_gpus: int, gpus_per_node: int) -> np.ndarray:
    """Like ``place_groups`` but never fails: each group gets the first rank of its tile, or -1 when no
    tile of its degree is left (largest degrees first, then the order given within a degree)."""
    degrees = np.asarray(degrees, dtype=np.int64)
    starts = np.full(len(degrees), -1, dtype=np.int64)
    if len(degrees) == 0:
        return starts
    values, counts = np.unique(degrees, return_counts=True)
    chosen = _place(dict(zip(values.tolist(), counts.tolist())), num_gpus, gpus_per_node, partial=True)
    for d, first in chosen.items():
        starts[np.flatnonzero(degrees == d)[:len(first)]] = first
    return starts


@dataclass(frozen=True)
class Placement:
    """``DegreeCosts.placeable`` for one cluster: whether group counts per degree index (of ``degrees``)
    place on ``num_gpus`` GPUs in nodes of ``gpus_per_node`` (a picklable callable, for worker processes)."""

    degrees: tuple[int, ...]
    num_gpus: int
    gpus_per_node: int

    def __call__(self, counts: np.ndarray) -> bool:
        return places(dict(zip(self.degrees, np.asarray(counts).tolist())), self.num_gpus, self.gpus_per_node)

    def tiles(self) -> tuple[int, ...]:
        """Tiles of each degree: the most groups of it one micro-batch holds."""
        return tuple(len(tile_starts(d, self.num_gpus, self.gpus_per_node)) for d in self.degrees)


def ulysses_split(degree: int, heads: int | None) -> tuple[int, int]:
    """(Ulysses part, ring part) of a group of ``degree`` GPUs for a model with ``heads`` query heads:
    the Ulysses part is the largest divisor of the degree that divides the heads (``gcd``), the ring
    takes the rest (rings run at any size). ``heads`` None: all Ulysses. For power-of-two degrees this
    is ``min(degree, largest power of two dividing heads)``."""
    ulysses = int(degree) if heads is None else math.gcd(int(degree), int(heads))
    return ulysses, int(degree) // ulysses


def tileable_degrees(num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """Every degree with a tile, ascending: 1..g inside a node, then each whole number of nodes."""
    g = node_size(num_gpus, gpus_per_node)
    return tuple(range(1, g + 1)) + tuple(range(2 * g, num_gpus + 1, g))


def untileable_reason(degree: int, num_gpus: int, gpus_per_node: int) -> str:
    """Why ``degree`` has no tile, in words (``""`` when it has one)."""
    g = node_size(num_gpus, gpus_per_node)
    if degree < 1:
        return f"{degree} GPUs: an SP degree must be >= 1"
    if degree > num_gpus:
        return f"{degree} GPUs: more than the cluster's {num_gpus}"
    if degree > g and degree % g:
        return f"{degree} GPUs: not inside a node of {g} nor whole nodes"
    return ""


def default_degrees(num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """The SP degrees plans use unless told otherwise, chosen by ``experiments/degrees_benchmark.py``
    (simulated): on power-of-two nodes every power of two with a tile (non-power-of-two sets gave
    plans 0.92-0.99x as fast once their extra communicators' memory is paid); on other node sizes
    (6, 12, ...) the powers of two and three times them with a tile (1, 2, 3, 4, 6, 12, 24, ... on nodes
    of 6: 1.09x faster plans than 1, 2, 4, which leave a third of each node idle for a long sequence).
    The rule reads the node size a cluster is built with, not a partial node's GPU count."""
    wanted = power_of_two_degrees(num_gpus)
    if gpus_per_node & (gpus_per_node - 1):
        wanted = tuple(sorted(set(wanted) | {3 * d for d in wanted if 3 * d <= num_gpus}))
    return tuple(d for d in wanted if tileable(d, num_gpus, gpus_per_node))


def nesting_subset(degrees: Iterable[int], num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """A chain of ``degrees`` that ``nests`` (built from the smallest up, keeping each degree the last
    kept one divides and that divides the node size when inside a node): the fallback set of a
    non-nesting one, for which ``place_groups`` never fails. Powers of two on power-of-two nodes keep all."""
    g = node_size(num_gpus, gpus_per_node)
    chain: list[int] = []
    for d in sorted(set(int(d) for d in degrees)):
        if tileable(d, num_gpus, gpus_per_node) and (not chain or d % chain[-1] == 0) and (d > g or g % d == 0):
            chain.append(d)
    return tuple(chain)


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs in nodes of ``gpus_per_node`` (any size: 6- or 12-GPU nodes too).

    SP groups sit on tiles (above): inside one node, or whole nodes. The GPU count is a whole number
    of nodes or one partial node, and need not be a power of two (48 = 6 nodes of 8).
    """

    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node"):
            object.__setattr__(self, name, integer(getattr(self, name), name, ClusterError, maximum=MAX_GPUS))
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ClusterError(
                f"num_gpus={self.num_gpus} spans several nodes but is not a multiple of "
                f"gpus_per_node={self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @property
    def degrees(self) -> tuple[int, ...]:
        """The default SP degrees (``default_degrees``), ascending: all powers of two up to N on
        power-of-two nodes; powers of two and three times them with a tile on other node sizes."""
        return default_degrees(self.num_gpus, self.gpus_per_node)

    @property
    def all_degrees(self) -> tuple[int, ...]:
        """Every SP degree with a tile (``tileable_degrees``): 1..node size, then whole nodes."""
        return tileable_degrees(self.num_gpus, self.gpus_per_node)

    def nests(self, degrees: Iterable[int]) -> bool:
        """Whether any micro-batch of these degrees that fits the GPU count also places (``nests``)."""
        return nests(degrees, self.num_gpus, self.gpus_per_node)

    def check_degrees(self, degrees: Iterable[int] | str) -> tuple[int, ...]:
        """``degrees`` sorted and deduplicated (``"any"``: ``all_degrees``, whatever a cost model can cost;
        ``PlanConfig`` filters those); a ``PlanError`` naming each one without a tile."""
        if isinstance(degrees, str) and degrees.strip().lower() == "any":
            return self.all_degrees
        if isinstance(degrees, (str, bytes)) or not isinstance(degrees, Iterable):
            raise PlanError(f"degrees must be \"any\" or a collection of SP degrees, got {degrees!r}")
        wanted = sorted({integer(d, "each of degrees", PlanError, maximum=MAX_GPUS) for d in degrees})
        if not wanted:
            raise PlanError("degrees is empty: give at least one SP degree, e.g. (1, 8, 64), or \"any\"")
        bad = [untileable_reason(d, self.num_gpus, self.gpus_per_node) for d in wanted]
        bad = [b for b in bad if b]
        if bad:
            raise PlanError(f"degrees not usable on {self.num_gpus} GPUs in nodes of {self.gpus_per_node}: "
                            f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} (a group sits inside one node "
                            f"or on whole nodes)")
        return tuple(wanted)

    def usable_degrees(self, max_degree: int | None = None, degrees: Iterable[int] | str | None = None) -> tuple[int, ...]:
        """The SP degrees a plan may use: ``degrees`` (any with a tile; default ``self.degrees``, the powers
        of two), optionally at most ``max_degree`` (each degree in use costs every member rank a communicator)."""
        usable = self.degrees if degrees is None else self.check_degrees(degrees)
        if max_degree is not None:
            usable = tuple(d for d in usable if d <= max_degree)
            if not usable:
                raise PlanError(f"max_degree={max_degree} leaves no SP degree (need >= 1)")
        return usable
