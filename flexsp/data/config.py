"""``LoaderConfig``: how global batches are formed and planned. Torch-free, so it can be built anywhere."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flexsp.data.errors import LoaderError
from flexsp.inputs import integer
from flexsp.plan.config import PlanConfig

TOO_LONG_POLICIES = ("error", "skip")


def planner_deadline(time_limit: float) -> float:
    """Seconds the loop waits for the planner when ``fallback_after`` is not set: generous (a spawned
    interpreter's start, a solve at its time limit plus the plan's conversion and validation), but finite."""
    return 30.0 + 4.0 * float(time_limit)


@dataclass(frozen=True)
class LoaderConfig:
    """Global-batch and planning settings; identical on every rank (only rank 0 uses most of them).
    ``plan`` (a ``PlanConfig``) holds every planning setting: strategy, time limit, degrees, ...

    Exactly one of ``batch_size`` (sequences per global batch) or ``max_tokens`` (a token budget:
    sequences are added in shuffled order while the batch stays within it) must be set.
    ``on_too_long`` decides what happens to a sequence no SP group of the cluster can hold:
    ``"error"`` stops with its dataset index and length, ``"skip"`` leaves it out and counts it in
    ``loader.stats.skipped_too_long``. ``lookahead`` bounds how many future global batches the
    background planner may solve ahead of training (0: plan synchronously in the loop).
    ``fallback_after``: if the loop has waited this many seconds for a plan, rank 0 plans that
    batch with the fast "greedy" strategy instead, with a warning, counted in ``step.plan.meta
    ["planner_fallbacks"]`` (None: ``planner_deadline(plan.time_limit)``, 30 s + 4 x the limit); below ``failure_timeout``
    where a planner runs ahead (``lookahead`` > 0), or the other ranks would time out before rank 0 falls back.
    ``failure_timeout``: seconds a rank waits for the others' plan or load outcome before it raises;
    a failure on one rank (a bad item, a failed plan) reaches every rank as the same ``LoaderError``.
    ``prefetch``: prepare the next step (plan broadcast, fetch, pack, device copies) on a background
    thread while the current one trains, so the loop waits only for what was not ready (False: every
    step is prepared in the loop, between steps). ``drop_last``: leave out each epoch's last batch when it
    holds fewer than ``batch_size`` sequences (PyTorch's and the HF Trainer's ``drop_last``; ``batch_size`` only).
    """

    batch_size: int | None = None
    max_tokens: int | None = None
    seed: int = 0
    shuffle: bool = True
    on_too_long: str = "error"
    plan: PlanConfig = field(default_factory=PlanConfig)   # how each global batch is planned
    lookahead: int = 2
    fallback_after: float | None = None
    failure_timeout: float = 300.0
    prefetch: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if (self.batch_size is None) == (self.max_tokens is None):
            raise LoaderError(f"set exactly one of batch_size (sequences per global batch) or max_tokens "
                              f"(tokens per global batch), got batch_size={self.batch_size}, "
                              f"max_tokens={self.max_tokens}")
        for name in ("batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise LoaderError(f"{name} must be a positive integer, got {value!r}")
        # the shuffle's seed; a numpy integer is taken as a Python one (the state a checkpoint saves is JSON)
        object.__setattr__(self, "seed", integer(self.seed, "seed", LoaderError, minimum=0, maximum=None))
        if self.on_too_long not in TOO_LONG_POLICIES:
            raise LoaderError(f"on_too_long={self.on_too_long!r}; choose one of {', '.join(TOO_LONG_POLICIES)}")
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise LoaderError(f"lookahead must be an integer >= 0 (0 plans synchronously), got {self.lookahead!r}")
        if not isinstance(self.plan, PlanConfig):
            raise LoaderError(f"plan must be a flexsp.PlanConfig, got {type(self.plan).__name__}")
        if not self.failure_timeout > 0:
            raise LoaderError(f"failure_timeout must be > 0 seconds, got {self.failure_timeout!r}")
        if not isinstance(self.prefetch, bool):
            raise LoaderError(f"prefetch must be True or False, got {self.prefetch!r}")
        if not isinstance(self.drop_last, bool):
            raise LoaderError(f"drop_last must be True or False, got {self.drop_last!r}")
        if self.drop_last and self.batch_size is None:
            raise LoaderError("drop_last=True needs batch_size: a token budget (max_tokens) has no full batch to compare "
                              "the last one with")
        if self.fallback_after is not None and not self.fallback_after > 0:
            raise LoaderError(f"fallback_after must be > 0 seconds or None, got {self.fallback_after}")
        deadline = self.planner_deadline()
        if self.lookahead > 0 and deadline >= self.failure_timeout:
            raise LoaderError(f"the planner's deadline ({deadline:g} s: fallback_after, or 30 s + 4 x plan.time_limit) "
                              f"is not below failure_timeout ({self.failure_timeout:g} s): a stalled planner would "
                              f"time the other ranks out before rank 0 falls back; lower fallback_after or raise "
                              f"failure_timeout")

    def planner_deadline(self) -> float:
        """Seconds the loop waits for the background planner before rank 0 plans the batch with the fallback."""
        return self.fallback_after if self.fallback_after is not None else planner_deadline(self.plan.time_limit)

    def batching_key(self) -> dict[str, Any]:
        """The settings that decide which sequences form which batch; a resumed run must match them."""
        return {k: getattr(self, k) for k in ("batch_size", "max_tokens", "seed", "shuffle", "on_too_long", "drop_last")}
