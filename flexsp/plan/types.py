"""A step's plan: micro-batches of concurrent SP groups, each a block of ranks and its sequences.

JSON form (the public contract):
``{"num_gpus", "predicted_time", "micro_batches": [{"groups": [{"ranks": [...], "seq_ids": [...]}]}]}``
plus optional ``strategy``, ``gpus_per_node`` and ``solve_time``.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from flexsp.errors import PlanError
from flexsp.inputs import (INT64_MAX, exact_sum, integer, limit, load_json, number, over_cap, parse_json,
                           raise_hint, too_large, write_text)
from flexsp.plan.cluster import is_tile_start
from flexsp.plan.lengths import as_lengths
from solver.types import LazyItems

if TYPE_CHECKING:
    from flexsp.plan.cluster import Cluster
    from flexsp.plan.cost import CostModel


@dataclass(frozen=True)
class Group:
    """One SP group: ``degree`` GPUs that run ``seq_ids`` one after another with Ulysses attention."""

    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]
    ring: int = 1    # ranks of the ring-attention axis; degree / ring run Ulysses (1: pure Ulysses)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def ulysses(self) -> int:
        return self.degree // self.ring


class PlacedGroups(LazyItems):
    """A micro-batch's groups as columns (first rank, degree and ring of each, all ids as one flat array cut
    by sizes) that reads as a tuple of ``Group``, built on first access, once. ``place`` returns these: the
    planner's own checks (``Plan.validate``, ``Plan.group_times``) and the loader's compact form read the
    columns, so a 16,384-GPU plan's 131,072 groups become objects only when a caller walks them. Equal to,
    hashed and pickled as the tuple of its groups. Groups on contiguous ranks only (what placement gives)."""

    __slots__ = ("first_ranks", "degrees", "rings", "ids", "sizes")

    def __init__(self, first_ranks: np.ndarray, degrees: np.ndarray, rings: np.ndarray, ids: np.ndarray,
                 sizes: np.ndarray) -> None:
        super().__init__()
        self.first_ranks, self.degrees, self.rings, self.ids, self.sizes = (
            np.asarray(a, dtype=np.int64) for a in (first_ranks, degrees, rings, ids, sizes))

    def _build(self) -> tuple[Group, ...]:
        ends = np.cumsum(self.sizes)
        ids, new, built = self.ids.tolist(), object.__new__, []
        for start, degree, ring, at, end in zip(self.first_ranks.tolist(), self.degrees.tolist(), self.rings.tolist(),
                                                (ends - self.sizes).tolist(), ends.tolist()):
            group = new(Group)           # the frozen __init__'s per-field object.__setattr__ costs 3x this
            fields = group.__dict__
            fields["ranks"], fields["seq_ids"], fields["ring"] = tuple(range(start, start + degree)), tuple(ids[at:end]), ring
            built.append(group)
        return tuple(built)

    def __len__(self) -> int:
        return len(self.degrees)

    def group(self, j: int) -> Group:
        """Group ``j`` alone, without building the others."""
        if self._items is not None:
            return self._items[j]
        at, start, degree = int(self.sizes[:j].sum()), int(self.first_ranks[j]), int(self.degrees[j])
        return Group(tuple(range(start, start + degree)), tuple(self.ids[at:at + int(self.sizes[j])].tolist()),
                     int(self.rings[j]))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, PlacedGroups)):
            return self.built() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.built())

    def __repr__(self) -> str:
        return repr(self.built())

    def __reduce__(self):
        return tuple, (self.built(),)


@dataclass(frozen=True)
class MicroBatch:
    """Groups that run at the same time on disjoint ranks; the slowest one sets the pace. ``groups`` is a
    tuple of ``Group`` or, from ``plan_batch``, ``PlacedGroups``: the same groups as columns, read the same way."""

    groups: Sequence[Group]

    def group_of_rank(self, rank: int) -> Group | None:
        if isinstance(self.groups, PlacedGroups):           # found on the columns; only that group is built
            g = self.groups
            hit = np.flatnonzero((g.first_ranks <= rank) & (rank < g.first_ranks + g.degrees))
            return g.group(int(hit[0])) if hit.size else None
        for group in self.groups:
            if rank in group.ranks:
                return group
        return None


@dataclass(frozen=True)
class Plan:
    num_gpus: int
    micro_batches: tuple[MicroBatch, ...]
    predicted_time: float
    strategy: str = ""
    gpus_per_node: int | None = None
    solve_time: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    # --- views --------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return sum(int(_sizes(mb).sum()) for mb in self.micro_batches)

    def degree_histogram(self) -> dict[int, int]:
        """How many groups of each degree the plan uses, over all micro-batches."""
        hist: Counter = Counter()
        for mb in self.micro_batches:
            if isinstance(mb.groups, PlacedGroups):
                hist.update(dict(zip(*(a.tolist() for a in np.unique(mb.groups.degrees, return_counts=True)))))
            else:
                hist.update(len(g.ranks) for g in mb.groups)
        return dict(sorted(hist.items()))

    def group_times(self, lengths: Sequence[int], cost: "CostModel") -> list[list[float]]:
        """Seconds of every group (beta1 included), per micro-batch; vectorised over sequences (one
        ``cost.seq_time`` call per distinct degree of a micro-batch, windowed and chunked layers included)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        out = []
        for m, mb in enumerate(self.micro_batches):
            sizes = _sizes(mb)
            owner = np.repeat(np.arange(len(mb.groups)), sizes)
            s = lengths[_int_array(m, mb, "seq_ids")]
            degree = np.repeat(_degrees(mb), sizes)
            per_seq = np.zeros(len(s))
            for d in np.unique(degree):
                mask = degree == d
                per_seq[mask] = cost.seq_time(s[mask], int(d))
            out.append((np.bincount(owner, weights=per_seq, minlength=len(mb.groups)) + cost.beta1).tolist())
        return out

    def time(self, lengths: Sequence[int], cost: "CostModel") -> float:
        """Step time under ``cost``: the sum over micro-batches of the slowest group."""
        return float(sum(max(times) for times in self.group_times(lengths, cost)))

    # --- rules --------------------------------------------------------------------------------
    def validate(self, lengths: Sequence[int] | None = None, cost: "CostModel | None" = None,
                 cluster: "Cluster | None" = None, *, aligned: bool = True, rel_tol: float = 1e-6) -> None:
        """Raise ``PlanError`` naming the first broken rule of docs/design.md; return None when valid.

        Checks that need data are skipped without it: exactly-once needs ``lengths``; memory and
        predicted time need ``lengths`` and ``cost``; node containment needs ``cluster``.
        """
        n = integer(self.num_gpus, "num_gpus", PlanError)
        if cluster is not None and cluster.num_gpus != n:
            raise PlanError(f"plan is for {n} GPUs but the cluster has {cluster.num_gpus}")
        if not self.micro_batches:
            raise PlanError("plan has no micro-batches")
        ids_per_mb = []
        for m, mb in enumerate(self.micro_batches):
            if not mb.groups:
                raise PlanError(f"micro-batch {m} has no groups")
            self._check_ranks(m, mb, cluster, aligned)
            self._check_split(m, mb, cost)
            ids_per_mb.append(_int_array(m, mb, "seq_ids"))
        all_ids = np.concatenate(ids_per_mb)
        mb_of = np.repeat(np.arange(len(ids_per_mb)), [len(ids) for ids in ids_per_mb])
        order = np.argsort(all_ids, kind="stable")
        repeated = np.flatnonzero(np.diff(all_ids[order]) == 0)
        if repeated.size:
            first, second = order[repeated[0]], order[repeated[0] + 1]
            raise PlanError(f"sequence {all_ids[first]} is planned twice "
                            f"(micro-batches {mb_of[first]} and {mb_of[second]})")
        if lengths is not None:
            lengths = as_lengths(lengths if isinstance(lengths, (list, tuple, np.ndarray)) else np.asarray(lengths))
            extra = np.sort(all_ids[(all_ids < 0) | (all_ids >= len(lengths))])
            if extra.size:
                raise PlanError(f"sequence ids {_short(extra.tolist())} do not exist (batch has {len(lengths)})")
            planned = np.zeros(len(lengths), dtype=bool)
            planned[all_ids] = True
            missing = np.flatnonzero(~planned)
            if missing.size:
                raise PlanError(f"sequences {_short(missing.tolist())} are not planned ({missing.size} of {len(lengths)})")
            if cost is not None:
                # int64 sums, vectorised, where no sum can wrap; else exact Python sums per group
                wide = int(lengths.max()) > INT64_MAX // max(1, len(lengths))
                capacity = {d: cost.group_capacity(d) for d in self.degree_histogram()}
                for m, (mb, ids) in enumerate(zip(self.micro_batches, ids_per_mb)):
                    if not wide:
                        sizes = _sizes(mb)
                        sums = np.add.reduceat(lengths[ids], np.concatenate([[0], np.cumsum(sizes)[:-1]]))
                        caps = per_degree(_degrees(mb), lambda d: min(capacity[d], INT64_MAX), np.int64)
                        if not (sums > caps).any():
                            continue
                    for j, g in enumerate(mb.groups):
                        tokens = exact_sum(lengths[list(g.seq_ids)])     # exact: int64 sums can wrap
                        if tokens > cost.group_capacity(g.degree):
                            raise PlanError(
                                f"micro-batch {m} group {j}: {tokens} tokens overflow {g.degree} GPUs "
                                f"(capacity {cost.group_capacity(g.degree)})")
                actual = self.time(lengths, cost)
                predicted = number(self.predicted_time, "predicted_time", PlanError)
                if not math.isclose(actual, predicted, rel_tol=rel_tol, abs_tol=1e-9):
                    raise PlanError(f"predicted_time {self.predicted_time} does not match the cost model's {actual}")

    @staticmethod
    def _check_split(m: int, mb: MicroBatch, cost: "CostModel | None") -> None:
        """Ulysses x ring = group size; the Ulysses degree divides the model's heads and the split is
        the one the cost model costs (when it knows the heads)."""
        if isinstance(mb.groups, PlacedGroups):          # one check per distinct (ring, degree), first group first
            g = mb.groups
            _, first = np.unique(g.rings * (int(g.degrees.max()) + 1) + g.degrees, return_index=True)
            splits = ((j, g.rings[j], g.degrees[j]) for j in np.sort(first).tolist())
        else:
            seen: set[tuple[str, str, int]] = set()
            splits = []
            for j, group in enumerate(mb.groups):
                key = (type(group.ring).__name__, repr(group.ring), len(group.ranks))
                if key not in seen:                        # same split as a group already checked
                    seen.add(key)
                    splits.append((j, group.ring, group.degree))
        for j, ring, degree in splits:
            ring, degree = integer(ring, f"micro-batch {m} group {j}: ring", PlanError), int(degree)
            if degree % ring:
                raise PlanError(f"micro-batch {m} group {j}: ring degree {ring} must divide "
                                f"the group's {degree} GPUs (Ulysses x ring = group size)")
            if cost is None:
                continue
            ulysses = degree // ring
            if cost.heads is not None and cost.heads % ulysses:
                raise PlanError(
                    f"micro-batch {m} group {j}: Ulysses degree {ulysses} (= {degree} GPUs / ring {ring}) does not "
                    f"divide the model's {cost.heads} attention heads; it needs ring = {cost.split(degree)[1]}")
            expected = cost.split(degree)
            if (ulysses, ring) != expected:
                raise PlanError(f"micro-batch {m} group {j}: runs Ulysses {ulysses} x ring {ring}, but the cost model "
                                f"costs {degree} GPUs as Ulysses {expected[0]} x ring {expected[1]}")

    def _check_ranks(self, m: int, mb: MicroBatch, cluster: "Cluster | None", aligned: bool) -> None:
        """Degrees, rank ranges, overlaps, alignment and node containment of one micro-batch, checked
        on all its ranks at once; the message names the first offending group."""
        n = self.num_gpus
        degrees = _degrees(mb)
        starts = np.concatenate([[0], np.cumsum(degrees)[:-1]])
        owner = np.repeat(np.arange(len(degrees)), degrees)
        ranks = _int_array(m, mb, "ranks")

        def fail(bad_group: np.ndarray, message) -> None:
            if bad_group.any():
                j = int(np.flatnonzero(bad_group)[0])
                raise PlanError(f"micro-batch {m} group {j}: {message(j)}")

        fail(degrees < 1, lambda j: "group has no ranks")
        fail(_sizes(mb) == 0, lambda j: "group has no sequences")
        columns = mb.groups if isinstance(mb.groups, PlacedGroups) else None
        fail((columns.rings < 1) | (degrees % np.maximum(columns.rings, 1) != 0) if columns is not None else
             np.array([isinstance(g.ring, bool) or not isinstance(g.ring, int) or g.ring < 1 or g.degree % g.ring
                       for g in mb.groups]),
             lambda j: f"ring degree {mb.groups[j].ring!r} must be a whole number dividing the group's {degrees[j]} GPUs")
        first = ranks[starts][owner]        # every group has >= 1 rank from here on
        outside = (ranks < 0) | (ranks >= n)
        fail(np.bincount(owner, weights=outside, minlength=len(degrees)) > 0,
             lambda j: f"rank {ranks[owner == j][outside[owner == j]][0]} is outside 0..{n - 1}")
        _, where, counts = np.unique(ranks, return_inverse=True, return_counts=True)   # O(ranks), not O(num_gpus)
        twice = counts[where] > 1
        fail(np.bincount(owner, weights=twice, minlength=len(degrees)) > 0,
             lambda j: f"rank {ranks[owner == j][twice[owner == j]][0]} is used by two groups of the same micro-batch")
        if aligned:
            gpn = cluster.gpus_per_node if cluster is not None else (self.gpus_per_node or n)
            off = (ranks != first + np.arange(len(ranks)) - starts[owner]) \
                | ~is_tile_start(first, degrees[owner], n, gpn)
            fail(np.bincount(owner, weights=off, minlength=len(degrees)) > 0,
                 lambda j: f"ranks {_short(mb.groups[j].ranks)} are not a tile of degree {degrees[j]} (consecutive "
                           f"ranks from a multiple of {degrees[j]} inside a node of {min(gpn, n)}, or whole nodes "
                           f"from a multiple of {degrees[j]})")
        if cluster is not None:
            gpn = cluster.gpus_per_node
            crosses = (ranks // gpn != first // gpn) & (degrees[owner] <= gpn)
            fail(np.bincount(owner, weights=crosses, minlength=len(degrees)) > 0,
                 lambda j: f"{degrees[j]} GPUs fit in one node but span nodes "
                           f"{sorted(set(r // gpn for r in mb.groups[j].ranks))}")

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:  # the keys of PLAN_KEYS
        return {
            "num_gpus": self.num_gpus,
            "predicted_time": self.predicted_time,
            "strategy": self.strategy,
            "gpus_per_node": self.gpus_per_node,
            "solve_time": self.solve_time,
            "micro_batches": [{"groups": [_group_dict(g) for g in mb.groups]} for mb in self.micro_batches],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Parse the JSON form; a malformed document raises ``PlanError`` saying what is wrong."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        for key in ("num_gpus", "predicted_time", "micro_batches"):
            if key not in data:
                raise PlanError(f"plan is missing '{key}'")
        _known_keys(data, PLAN_KEYS, "the plan")
        num_gpus = _gpus(data["num_gpus"], "num_gpus")
        gpn = data.get("gpus_per_node")
        gpn = None if gpn is None else _gpus(gpn, "gpus_per_node")
        predicted = number(data["predicted_time"], "predicted_time (seconds)", PlanError)
        if not isinstance(data["micro_batches"], list):
            raise PlanError("micro_batches must be a list")
        batches = len(data["micro_batches"])
        if batches > limit("groups"):   # each needs a group: millions of empty ones fail here, not after building
            raise PlanError(f"the plan has {batches} micro-batches, which need at least {batches} groups, over the cap "
                            f"of {limit('groups')}; {raise_hint('groups')}")
        count = sum(len(mb["groups"]) for mb in data["micro_batches"]
                    if isinstance(mb, Mapping) and isinstance(mb.get("groups"), list))
        if count > limit("groups"):   # checked before a Group is built: each costs hundreds of bytes
            raise PlanError(too_large("the plan", count, "groups"))
        micro_batches = []
        for m, mb in enumerate(data["micro_batches"]):
            if not isinstance(mb, Mapping) or not isinstance(mb.get("groups"), list):
                raise PlanError(f"micro_batches[{m}] must be an object with a 'groups' list")
            _known_keys(mb, ("groups",), f"micro_batches[{m}]")
            groups = []
            for j, g in enumerate(mb["groups"]):
                where = f"micro_batches[{m}].groups[{j}]"
                if not isinstance(g, Mapping) or not isinstance(g.get("ranks"), list) or not isinstance(g.get("seq_ids"), list):
                    raise PlanError(f"{where} must be an object with 'ranks' and 'seq_ids' lists")
                _known_keys(g, GROUP_KEYS, where)
                groups.append(Group(ranks=tuple(_int(r, f"{where}.ranks") for r in g["ranks"]),
                                    seq_ids=tuple(_int(s, f"{where}.seq_ids") for s in g["seq_ids"]),
                                    ring=integer(g.get("ring", 1), f"{where}.ring", PlanError)))
            micro_batches.append(MicroBatch(tuple(groups)))
        strategy = data.get("strategy")
        if strategy is not None and not isinstance(strategy, str):
            raise PlanError(f"strategy must be a string, got {strategy!r}")
        solve_time = data.get("solve_time")
        return cls(num_gpus=num_gpus, micro_batches=tuple(micro_batches), predicted_time=predicted,
                   strategy=strategy or "",
                   gpus_per_node=gpn,
                   solve_time=0.0 if solve_time is None else number(solve_time, "solve_time (seconds)", PlanError))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(parse_json(text, "plan", PlanError))

    def save(self, path: str | Path) -> None:
        write_text(path, self.to_json(), "plan", PlanError)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return load_json(path, "plan file", PlanError, cls.from_dict)


PLAN_KEYS = ("num_gpus", "predicted_time", "strategy", "gpus_per_node", "solve_time", "micro_batches")
GROUP_KEYS = ("ranks", "seq_ids", "ring")


def _known_keys(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse a key the plan format does not have: a typo (``"rings": 2``) would otherwise be dropped silently."""
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise PlanError(f"{where} has unknown keys {unknown} (a typo?); its keys are {', '.join(known)}")


def _group_dict(group: Group) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": list(group.ranks), "seq_ids": list(group.seq_ids)}
    if group.ring > 1:      # only hybrid groups carry the split; the contract's keys stay as they are
        out["ring"] = group.ring
    return out


def _gpus(value: Any, what: str) -> int:
    """A GPU count of a plan file, within the ``gpus`` cap ``--gpus`` has: a reader (replay's preset cost
    model, tile tables) sizes allocations by it, so 2**62 is an error here, not a MemoryError there."""
    n = integer(value, what, PlanError)
    if n > limit("gpus"):
        raise PlanError(over_cap(what, n, "gpus", "GPUs"))
    return n


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what} must hold integers, got {value!r}")
    if not 0 <= value <= INT64_MAX:
        raise PlanError(f"{what} must hold integers from 0 to 2**63-1, got {value}")
    return value


def per_degree(degrees: np.ndarray, value, dtype=np.float64) -> np.ndarray:
    """``value(d)`` for each entry of ``degrees``, called once per distinct degree (a plan has a handful of
    degrees and up to 131,072 groups)."""
    out = np.empty(len(degrees), dtype=dtype)
    for d in set(degrees.tolist()):
        out[degrees == d] = value(d)
    return out


def _degrees(mb: MicroBatch) -> np.ndarray:
    """Each group's degree (its rank count)."""
    groups = mb.groups
    if isinstance(groups, PlacedGroups):
        return groups.degrees
    return np.fromiter((len(g.ranks) for g in groups), dtype=np.int64, count=len(groups))


def _sizes(mb: MicroBatch) -> np.ndarray:
    """How many sequences each group runs."""
    groups = mb.groups
    if isinstance(groups, PlacedGroups):
        return groups.sizes
    return np.fromiter((len(g.seq_ids) for g in groups), dtype=np.int64, count=len(groups))


def _int_array(m: int, mb: MicroBatch, what: str) -> np.ndarray:
    """All groups' ``ranks`` or ``seq_ids`` of a micro-batch as one int64 array; a value that is not
    an integer in int64's range is a ``PlanError`` naming its group (columns are int64 already)."""
    if isinstance(mb.groups, PlacedGroups):
        g = mb.groups
        if what == "seq_ids":
            return g.ids
        offsets = np.cumsum(g.degrees) - g.degrees              # each group's block of consecutive ranks
        return np.repeat(g.first_ranks - offsets, g.degrees) + np.arange(int(g.degrees.sum()))
    values = [v for g in mb.groups for v in getattr(g, what)]
    kinds = set(map(type, values))                  # C-speed type scan; the per-value loop only on a bad value
    if all(k is not bool and issubclass(k, (int, np.integer)) and not issubclass(k, np.bool_) for k in kinds):
        try:
            return np.array(values, dtype=np.int64).reshape(len(values))
        except OverflowError:
            pass
    for j, g in enumerate(mb.groups):
        for value in getattr(g, what):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                    or not -INT64_MAX <= value <= INT64_MAX:
                raise PlanError(f"micro-batch {m} group {j}: {what} must hold integers in int64's range, got {value!r}")
    return np.fromiter(values, dtype=np.int64)


def _short(items: Sequence[int], limit: int = 8) -> str:
    items = list(items)
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"
