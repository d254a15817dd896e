"""A step's plan: micro-batches of concurrent SP groups, each a block of ranks and its sequences.

JSON form (the public contract):
``{"num_gpus", "predicted_time", "micro_batches": [{"groups": [{"ranks": [...], "seq_ids": [...]}]}]}``
plus optional ``strategy``, ``gpus_per_node`` and ``solve_time``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .cluster import is_power_of_two
from .errors import PlanError

if TYPE_CHECKING:
    from .cluster import Cluster
    from .cost import CostModel


@dataclass(frozen=True)
class Group:
    """One SP group: ``degree`` GPUs that run ``seq_ids`` one after another with Ulysses attention."""

    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]

    @property
    def degree(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class MicroBatch:
    """Groups that run at the same time on disjoint ranks; the slowest one sets the pace."""

    groups: tuple[Group, ...]

    def group_of_rank(self, rank: int) -> Group | None:
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
        return sum(len(g.seq_ids) for mb in self.micro_batches for g in mb.groups)

    def degree_histogram(self) -> dict[int, int]:
        """How many groups of each degree the plan uses, over all micro-batches."""
        hist: dict[int, int] = {}
        for mb in self.micro_batches:
            for g in mb.groups:
                hist[g.degree] = hist.get(g.degree, 0) + 1
        return dict(sorted(hist.items()))

    def group_times(self, lengths: Sequence[int], cost: "CostModel") -> list[list[float]]:
        lengths = np.asarray(lengths)
        return [[cost.group_time(lengths[list(g.seq_ids)], g.degree) for g in mb.groups]
                for mb in self.micro_batches]

    def time(self, lengths: Sequence[int], cost: "CostModel") -> float:
        """Step time under ``cost``: the sum over micro-batches of the slowest group."""
        return float(sum(max(times) for times in self.group_times(lengths, cost)))

    # --- rules --------------------------------------------------------------------------------
    def validate(self, lengths: Sequence[int] | None = None, cost: "CostModel | None" = None,
                 cluster: "Cluster | None" = None, *, aligned: bool = True, rel_tol: float = 1e-6) -> None:
        """Raise ``PlanError`` naming the first broken rule of DESIGN.md; return None when valid.

        Checks that need data are skipped without it: exactly-once needs ``lengths``; memory and
        predicted time need ``lengths`` and ``cost``; node containment needs ``cluster``.
        """
        n = self.num_gpus
        if not isinstance(n, int) or n < 1:
            raise PlanError(f"num_gpus must be a positive integer, got {n!r}")
        if cluster is not None and cluster.num_gpus != n:
            raise PlanError(f"plan is for {n} GPUs but the cluster has {cluster.num_gpus}")
        if not self.micro_batches:
            raise PlanError("plan has no micro-batches")
        seen: dict[int, int] = {}
        for m, mb in enumerate(self.micro_batches):
            if not mb.groups:
                raise PlanError(f"micro-batch {m} has no groups")
            used: set[int] = set()
            for j, g in enumerate(mb.groups):
                where = f"micro-batch {m} group {j}"
                d = g.degree
                if not is_power_of_two(d):
                    raise PlanError(f"{where}: degree {d} is not a power of two")
                if not g.seq_ids:
                    raise PlanError(f"{where}: group has no sequences")
                for r in g.ranks:
                    if not 0 <= r < n:
                        raise PlanError(f"{where}: rank {r} is outside 0..{n - 1}")
                    if r in used:
                        raise PlanError(f"{where}: rank {r} is used by two groups of the same micro-batch")
                    used.add(r)
                if aligned and (tuple(g.ranks) != tuple(range(g.ranks[0], g.ranks[0] + d)) or g.ranks[0] % d):
                    raise PlanError(f"{where}: ranks {_short(g.ranks)} are not an aligned block [k*{d}, (k+1)*{d})")
                if cluster is not None and d <= cluster.gpus_per_node:
                    nodes = {cluster.node_of(r) for r in g.ranks}
                    if len(nodes) > 1:
                        raise PlanError(f"{where}: {d} GPUs fit in one node but span nodes {sorted(nodes)}")
                for s in g.seq_ids:
                    if s in seen:
                        raise PlanError(f"sequence {s} is planned twice (micro-batches {seen[s]} and {m})")
                    seen[s] = m
        if lengths is not None:
            lengths = np.asarray(lengths)
            missing = sorted(set(range(len(lengths))) - set(seen))
            if missing:
                raise PlanError(f"sequences {_short(missing)} are not planned ({len(missing)} of {len(lengths)})")
            extra = sorted(s for s in seen if not 0 <= s < len(lengths))
            if extra:
                raise PlanError(f"sequence ids {_short(extra)} do not exist (batch has {len(lengths)})")
            if cost is not None:
                for m, mb in enumerate(self.micro_batches):
                    for j, g in enumerate(mb.groups):
                        tokens = int(lengths[list(g.seq_ids)].sum())
                        if not cost.fits(lengths[list(g.seq_ids)], g.degree):
                            raise PlanError(
                                f"micro-batch {m} group {j}: {tokens} tokens overflow {g.degree} GPUs "
                                f"(capacity {cost.group_capacity(g.degree):.0f})")
                actual = self.time(lengths, cost)
                if not math.isclose(actual, self.predicted_time, rel_tol=rel_tol, abs_tol=1e-9):
                    raise PlanError(f"predicted_time {self.predicted_time} does not match the cost model's {actual}")

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_gpus": self.num_gpus,
            "predicted_time": self.predicted_time,
            "strategy": self.strategy,
            "gpus_per_node": self.gpus_per_node,
            "solve_time": self.solve_time,
            "micro_batches": [{"groups": [{"ranks": list(g.ranks), "seq_ids": list(g.seq_ids)} for g in mb.groups]}
                              for mb in self.micro_batches],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Parse the JSON form; a malformed document raises ``PlanError`` saying what is wrong."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        for key in ("num_gpus", "predicted_time", "micro_batches"):
            if key not in data:
                raise PlanError(f"plan is missing '{key}'")
        num_gpus = _int(data["num_gpus"], "num_gpus")
        try:
            predicted = float(data["predicted_time"])
        except (TypeError, ValueError):
            raise PlanError(f"predicted_time must be a number, got {data['predicted_time']!r}") from None
        if not isinstance(data["micro_batches"], list):
            raise PlanError("micro_batches must be a list")
        micro_batches = []
        for m, mb in enumerate(data["micro_batches"]):
            if not isinstance(mb, Mapping) or not isinstance(mb.get("groups"), list):
                raise PlanError(f"micro_batches[{m}] must be an object with a 'groups' list")
            groups = []
            for j, g in enumerate(mb["groups"]):
                where = f"micro_batches[{m}].groups[{j}]"
                if not isinstance(g, Mapping) or not isinstance(g.get("ranks"), list) or not isinstance(g.get("seq_ids"), list):
                    raise PlanError(f"{where} must be an object with 'ranks' and 'seq_ids' lists")
                groups.append(Group(ranks=tuple(_int(r, f"{where}.ranks") for r in g["ranks"]),
                                    seq_ids=tuple(_int(s, f"{where}.seq_ids") for s in g["seq_ids"])))
            micro_batches.append(MicroBatch(tuple(groups)))
        gpn = data.get("gpus_per_node")
        return cls(num_gpus=num_gpus, micro_batches=tuple(micro_batches), predicted_time=predicted,
                   strategy=str(data.get("strategy") or ""),
                   gpus_per_node=None if gpn is None else _int(gpn, "gpus_per_node"),
                   solve_time=float(data.get("solve_time") or 0.0))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc}") from None
        try:
            return cls.from_json(text)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{what} must hold integers, got {value!r}")
    return value


def _short(items: Sequence[int], limit: int = 8) -> str:
    items = list(items)
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"
