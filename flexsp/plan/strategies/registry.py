"""The registry of planning strategies: the one place a strategy is named, described and wired.

``plan_batch``, ``flexsp simulate`` (its default comparison and ``--strategies`` check), the CLI
help and the README's strategy list all read this registry, so a new baseline is one module with a
planning function plus one ``register_strategy(Strategy(...))`` call. A planning function gets a
``PlanRequest`` (the solver's view of the batch) and returns a ``solver.types.Schedule``; the
planner places, scores and validates it like any other strategy's.
"""
from __future__ import annotations

import math

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flexsp.errors import PlanError
from solver.search import SearchOptions
from solver.types import DegreeCosts, Schedule

# plan_batch options every strategy honours; a strategy lists any others it accepts in ``options``
COMMON_OPTIONS = frozenset({"time_limit", "num_buckets", "max_degree", "degrees", "ulysses_only", "validate"})


@dataclass(frozen=True)
class PlanRequest:
    """What a planning function sees: lengths, per-degree costs (only the usable degrees), the GPU
    count, search options, the strategy-specific ``sp_degree``, the wall-clock ``deadline``
    (``time.perf_counter()`` seconds) and, for a strategy with ``candidates``, one thunk per
    candidate strategy that plans the same request with it. ``fallback``: the costs of the nesting subset
    of ``costs.degrees`` when those do not nest (non-power-of-two sets; None otherwise), for a strategy
    whose rule assumes a degree ladder (dynamic-cp doubles group sizes)."""

    lengths: np.ndarray
    costs: DegreeCosts
    num_gpus: int
    options: SearchOptions
    deadline: float
    sp_degree: int | None = None
    candidates: tuple[Callable[[], Schedule], ...] = ()
    fallback: DegreeCosts | None = None


@dataclass(frozen=True)
class Strategy:
    """One planning strategy. ``options``: the ``plan_batch`` arguments it takes beyond
    ``COMMON_OPTIONS`` (only ``"sp_degree"`` today: ``plan_batch`` refuses it for the others, and
    ``simulate`` accepts ``NAME:D`` for it). ``candidates``: strategies whose plans its planning
    function receives as ``PlanRequest.candidates`` thunks (FlexSP keeps the best, so it is never
    slower than one of them). ``in_default_comparison``: listed by ``default_strategies``."""

    name: str
    plan: Callable[[PlanRequest], Schedule]
    description: str                                   # one line, shown in the CLI help and the README
    options: frozenset[str] = frozenset()              # plan_batch options beyond COMMON_OPTIONS, e.g. "sp_degree"
    candidates: tuple[str, ...] = ()                   # strategies whose plans this one also considers
    in_default_comparison: bool = True                 # listed by flexsp.evaluation.simulate.default_strategies

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", frozenset(self.options))
        object.__setattr__(self, "candidates", tuple(self.candidates))
        unknown = self.options - COMMON_OPTIONS - {"sp_degree"}
        if not self.name or not isinstance(self.name, str) or any(c in self.name for c in ",:[] "):
            raise PlanError(f"strategy name {self.name!r} must be a non-empty string without ',:[] '")
        if unknown:
            raise PlanError(f"strategy {self.name!r}: unknown plan_batch options {sorted(unknown)}")

    @property
    def accepts_sp_degree(self) -> bool:
        return "sp_degree" in self.options


@dataclass
class _Registry:
    """Insertion-ordered name -> Strategy. The one piece of module-level state in the planner, on
    purpose: a registration must be visible to ``plan_batch``, the CLI and ``simulate`` alike.
    Worker processes (``simulate --workers``) re-import this module, so they see the built-ins and
    what their modules register at import, not what a parent registered at run time."""

    entries: dict[str, Strategy] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_strategy(strategy: Strategy) -> Strategy:
    """Add ``strategy`` (listed after those before it); a ``PlanError`` if its name is taken.
    Candidates are looked up when it plans, so they may be registered after it."""
    if strategy.name in _REGISTRY.entries:
        raise PlanError(f"a strategy named {strategy.name!r} is already registered; pick another name "
                        f"(registered: {', '.join(names())})")
    _REGISTRY.entries[strategy.name] = strategy
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (tests, plugins); a ``PlanError`` naming the valid ones if unknown
    or if another strategy lists it as a candidate."""
    get_strategy(name)
    users = [s.name for s in _REGISTRY.entries.values() if name in s.candidates]
    if users:
        raise PlanError(f"strategy {name!r} is a candidate of {users}; unregister those first")
    del _REGISTRY.entries[name]


def get_strategy(name: object) -> Strategy:
    if not isinstance(name, str) or name not in _REGISTRY.entries:
        raise PlanError(f"unknown strategy {name!r}; choose one of {', '.join(names())}")
    return _REGISTRY.entries[name]


def strategies() -> tuple[Strategy, ...]:
    return tuple(_REGISTRY.entries.values())


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY.entries)


def run_strategy(name: str, request: PlanRequest) -> Schedule:
    """Plan ``request`` with strategy ``name``, its candidates wired in as thunks."""
    strategy = get_strategy(name)
    thunks = tuple((lambda c=c: run_strategy(c, _without_candidates(request))) for c in strategy.candidates)
    return strategy.plan(PlanRequest(request.lengths, request.costs, request.num_gpus, request.options,
                                     request.deadline, request.sp_degree, thunks, request.fallback))


def _without_candidates(request: PlanRequest) -> PlanRequest:
    """A candidate's request: no candidates of its own, and no deadline. The candidates are cheap
    (batchada 0.25 s, dynamic-cp 0.05 s at 16,384 sequences; they run on batches of at most
    ``solver.search.MAX_FALLBACK_SEQUENCES``), and a search cut short by its deadline must still return
    a plan no worse than theirs, not than their own cut-short plans."""
    return PlanRequest(request.lengths, request.costs, request.num_gpus, request.options, math.inf,
                       fallback=request.fallback)


@dataclass(frozen=True)
class StrategySpec:
    """A strategy written as ``NAME``, ``NAME:D`` or ``NAME[D,D,...]``, taken apart (``parse_strategy``)."""

    strategy: str
    sp_degree: int | None = None
    degrees: tuple[int, ...] | str | None = None


def parse_strategy_list(text: str) -> list[str]:
    """Comma-separated names, commas inside ``[...]`` kept: ``flexsp,flexsp[1,8,64]``."""
    return [m.strip() for m in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if m.strip()]


def parse_strategy(name: str) -> StrategySpec:
    """``flexsp`` / ``static:32`` / ``flexsp[1,8,64]`` -> what to pass to ``plan_batch``: the one strategy
    syntax of ``PlanConfig(strategy=...)``, ``flexsp plan --strategy`` and ``flexsp simulate --strategies``.
    ``NAME:D`` pins ``sp_degree`` for a strategy that accepts it; ``NAME[1,8,64]`` or ``NAME[any]`` restricts
    its degrees. The name itself is checked by ``get_strategy`` (a ``PlanError`` listing the registered ones)."""
    degrees = None
    if name.endswith("]") and "[" in name:
        name, inside = name[:-1].split("[", 1)
        try:
            degrees = "any" if inside.strip().lower() == "any" else tuple(int(d) for d in inside.split(",") if d.strip())
        except ValueError:
            raise PlanError(f"degrees in [{inside}] must be integers or any, e.g. flexsp[1,8,64] or flexsp[any]") from None
    if ":" in name:
        base, degree = name.split(":", 1)
        if not get_strategy(base).accepts_sp_degree:
            raise PlanError(f"{name!r}: strategy {base!r} takes no SP degree; "
                            f"{', '.join(s.name + ':D' for s in strategies() if s.accepts_sp_degree)} does")
        try:
            return StrategySpec(base, int(degree), degrees)
        except ValueError:
            raise PlanError(f"{base} degree in {name!r} must be an integer, e.g. {base}:32") from None
    return StrategySpec(name, None, degrees)


def describe_strategies(indent: str = "") -> str:
    """One line per strategy: ``name: description`` (the CLI help and the README list)."""
    return "\n".join(f"{indent}{s.name}: {s.description}" for s in strategies())


def markdown_list() -> str:
    """The strategy list of docs/concepts.md (``tests/test_strategies.py`` checks it holds exactly this)."""
    return "\n".join(f"- `{s.name}`: {s.description}" for s in strategies())


__all__ = ["Strategy", "StrategySpec", "parse_strategy", "parse_strategy_list", "PlanRequest", "register_strategy", "unregister_strategy", "get_strategy", "strategies",
           "names", "run_strategy", "describe_strategies", "markdown_list", "COMMON_OPTIONS"]
