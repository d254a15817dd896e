"""``FlexSPLoader``: a map-style dataset in, this rank's packed micro-batches of every step out.

Per step: rank 0 takes the next global batch's plan from the background planner and broadcasts it
(``broadcast_object_list`` of a JSON-safe dict on a gloo side group with ``config.failure_timeout``:
the batch's dataset indices and lengths, the plan, or the error that stopped planning), so every rank
runs the same plan and a solver failure raises the same ``LoaderError`` everywhere instead of leaving
ranks waiting. Each rank then fetches only the items of its own groups, packs them and keeps its
shard; a data error on any rank (a bad item, a stale length, a read that hangs past the timeout) is
agreed on the side group (``flexsp.runtime.failures``) so every rank raises it, none waits.
While the caller trains on one step, the next one is prepared on a background thread
(``flexsp.data.prefetch``: broadcast, fetch, pack, device copies on a side CUDA stream), so the loop
waits only for what was not ready yet (``config.prefetch``); ``start()`` sets the first step preparing
the same way (while the model is built), else the first step is prepared in the loop.
Plans use only the pool's degrees (and Ulysses x ring splits). Without a process group (or with one rank)
the loader plans for ``cluster.num_gpus`` ranks and loads the share of ``rank``, which is how one
process can stand in for one rank of a large cluster.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from flexsp.data.batching import EpochBatches
from flexsp.data.collate import Row, read_row, shard_group
from flexsp.data.config import LoaderConfig
from flexsp.data.errors import LoaderError
from flexsp.data.planning import AsyncPlanner, PlanBatch, PlannedBatch, Solver, pack_plan, unpack_plan
from flexsp.data.prefetch import Prefetch
from flexsp.data.source import read_item, resolve_lengths
from flexsp.inputs import integer
from flexsp.plan.cluster import Cluster
from flexsp.plan.cost import CostModel
from flexsp.plan.memory import assumed as assumed_sharding
from flexsp.plan.types import Plan
from flexsp.runtime.failures import ControlGroup, error_line
from flexsp.runtime.pool import GroupPool
from flexsp.runtime.step import Step

STATE_VERSION = 1
_log = logging.getLogger("flexsp.loader")
EXIT_WAIT_S = 30.0   # the longest an exit waits for a step in preparation (see _close_at_exit)


@dataclass
class LoaderStats:
    """Totals over the steps handed to the loop. ``wait_seconds`` is what the loop itself lost: the time it
    blocked for steps (= the steps' ``plan_wait + load_seconds``); the ``prepare_*`` figures are the
    preparations' own times, hidden behind the previous step when prefetched."""

    steps: int = 0                   # steps handed to the loop
    skipped_too_long: int = 0        # sequences per epoch left out by on_too_long="skip"
    wait_seconds: float = 0.0        # the loop blocked for steps, in total
    max_wait: float = 0.0
    plan_wait_seconds: float = 0.0   # the part of wait_seconds spent waiting for plans
    max_plan_wait: float = 0.0
    load_seconds: float = 0.0        # the part of wait_seconds spent fetching, packing and copying
    prepare_plan_seconds: float = 0.0   # preparations waiting for plans (incl. broadcast), wherever they ran
    prepare_load_seconds: float = 0.0   # preparations fetching, packing and copying, wherever they ran
    prefetched: int = 0              # steps prepared on the background thread
    solve_seconds: float = 0.0       # planner's solve time (planning rank only)
    fallbacks: int = 0
    max_ahead: int = 0               # most batches solved ahead of the loop (<= lookahead)


class FlexSPLoader:
    """Iterate a map-style ``dataset`` of token sequences as planned, per-rank FlexSP steps.

    ``for step in loader`` runs one epoch from the current position; iterate again for the next.
    Items may be lists, tuples, numpy arrays, 1-D tensors or mappings with ``input_ids`` (Hugging
    Face ``datasets`` rows); a mapping's ``labels`` (HF: aligned, unshifted, -100 = no loss), TRL's
    ``completion_mask`` / ``assistant_masks`` (1 = loss) say which targets carry loss
    (``flexsp.runtime.labels``; checked against ``vocab_size`` when given), and ``Step.loss_tokens`` is the
    global batch's count of them, summed over the ranks on the load agreement. Lengths come from ``lengths``, a ``"length"`` column, or one ``len()``
    pass over the items on the planning rank (see ``flexsp.data.source``). ``pool`` (a ``GroupPool``
    over ``cluster.num_gpus`` ranks) is needed with more than one process and supplies each shard's
    process group; without it the loader stands in for ``rank`` of the cluster. ``planner``, if
    given, replaces ``plan_batch``: ``planner(lengths) -> Plan``. Plans use only ``pool.degrees``, and a
    degree the cost model runs as Ulysses x ring only when the pool holds that split
    (``GroupPool(heads=cost.heads)``); ``config.plan.ulysses_only`` keeps every group within
    the model's Ulysses limit. Call ``close()`` (or use ``with``).
    With a pool of several ranks, build it on every rank at the same point: it creates a gloo side group
    for plans and load outcomes (``config.failure_timeout``).
    """

    def __init__(self, dataset: Sequence[Any], cost: CostModel, cluster: Cluster, config: LoaderConfig, *,
                 lengths: Any = None, pool: GroupPool | None = None, rank: int | None = None,
                 planner: Solver | None = None, device: torch.device | str | None = None,
                 vocab_size: int | None = None) -> None:
        if not isinstance(config, LoaderConfig):
            raise LoaderError(f"config must be a flexsp.data.LoaderConfig, got {type(config).__name__}")
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise LoaderError(f"dataset must be map-style (__len__ and __getitem__), got {type(dataset).__name__}")
        self.dataset, self.cost, self.cluster, self.config = dataset, cost, cluster, config
        self.vocab_size = None if vocab_size is None else integer(vocab_size, "vocab_size", LoaderError)
        self.pool = pool
        self.sharding = assumed_sharding(cost)
        self.device = None if device is None else torch.device(device)
        initialized = dist.is_available() and dist.is_initialized()
        if pool is not None:
            if cluster.num_gpus != pool.world_size:
                raise LoaderError(f"the cluster has {cluster.num_gpus} GPUs but the pool's world has "
                                  f"{pool.world_size} ranks; plan for the world you run")
            if rank is not None and rank != pool.rank:
                raise LoaderError(f"rank={rank} disagrees with the pool's rank {pool.rank}; leave rank unset")
            self.rank, self._communicate = pool.rank, pool.world_size > 1
        else:
            if initialized and dist.get_world_size() > 1:
                raise LoaderError(f"{dist.get_world_size()} processes are running: pass pool=GroupPool() so "
                                  f"the loader can hand each micro-batch its SP group")
            self.rank, self._communicate = (0 if rank is None else int(rank)), False
            if not 0 <= self.rank < cluster.num_gpus:
                raise LoaderError(f"rank {self.rank} is outside the cluster's ranks 0..{cluster.num_gpus - 1}")
        self.plans_here = not self._communicate or self.rank == 0   # this process runs the solver
        # plan broadcast and load outcomes go over a gloo side group with config.failure_timeout
        self._control = ControlGroup(config.failure_timeout) if self._communicate else None
        self._lengths_arg = lengths
        self._custom_planner = planner is not None
        self._solve = planner if planner is not None else self._plan_with(config.plan.strategy)
        self._fallback = self._plan_with("greedy")   # the safe plan when the planner misses its deadline
        self._fallbacks = 0                           # steps planned by the fallback, in the steps' plan meta
        self._digest = self._own_digest = None        # the dataset's digest in the saved state (see state_dict)
        self._left_out = None                         # rank 0's left_out(), sent with every plan (see state_dict)
        self._lengths: np.ndarray | None = None
        self._batches: EpochBatches | None = None
        self._planner: AsyncPlanner | None = None
        self._planner_next: tuple[int, int] | None = None
        self._epoch = self._index = self._step = 0   # the next step to prepare
        self._position = (0, 0, 0)                    # the next step to hand out: (epoch, index, step)
        self._ahead: Prefetch[Step] | None = None     # the next step, being prepared on the loader thread
        self._stream = None                           # its CUDA side stream (made on first use)
        self._new_solver = False                      # set_cost's solver, not yet sent to the planner
        self.stats = LoaderStats()
        # a script may end while the loader thread still prepares a step (seen: importing the solver as the gloo
        # world went down): left to interpreter shutdown, that aborted about one exit in four ("terminate called
        # without an active exception"). Registered after the pool's own handler, so this one runs first.
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- planning (rank 0) ----------------------------------------------------------------------
    def _plan_with(self, strategy: str) -> Solver:
        """A picklable ``plan_batch`` solver, so the background planner can run it in its own process."""
        plan = self.config.plan
        return PlanBatch(self.cost, self.cluster, plan.replace(strategy=strategy, degrees=self._degrees,
                                                               sp_degree=plan.sp_degree if strategy == plan.strategy else None))

    def set_cost(self, cost: CostModel) -> None:
        """Plan the batches submitted from now on with ``cost`` (e.g. ``flexsp.telemetry``'s refit); the step
        being prepared ahead and the up to ``lookahead`` batches already with the planner keep theirs. Only the
        times may change: the token capacity and sharding batching and the executor rely on must be the same."""
        if not isinstance(cost, CostModel):
            raise LoaderError(f"set_cost takes a flexsp.CostModel, got {type(cost).__name__}")
        if cost.token_capacity != self.cost.token_capacity or assumed_sharding(cost) != self.sharding:
            raise LoaderError(f"the new cost model changes the token capacity ({self.cost.token_capacity:.0f} -> "
                              f"{cost.token_capacity:.0f}) or sharding; only its times may change during a run")
        if self._custom_planner:
            raise LoaderError("this loader plans with a custom planner=; give that planner the new cost model")
        self.cost = cost
        self._solve = self._plan_with(self.config.plan.strategy)
        self._fallback = self._plan_with("greedy")
        self._new_solver = True   # sent by the thread that talks to the planner, before its next batch

    @property
    def _degrees(self) -> tuple[int, ...] | None:
        """The SP degrees the runtime can run (None without a pool: any): the pool's, less those the cost
        model runs as a Ulysses x ring split the pool does not hold."""
        wanted = self.config.plan.degrees
        if self.pool is None:
            return wanted
        splits = set(getattr(self.pool, "splits", ()))
        return tuple(d for d in self.pool.degrees if (self.cost.split(d)[1] == 1 or self.cost.split(d) in splits)
                     and (wanted is None or d in wanted))

    @property
    def lengths(self) -> np.ndarray:
        """Every item's length, resolved on first use (may read every item: see ``flexsp.data.source``)."""
        if self._lengths is None:
            self._lengths = resolve_lengths(self.dataset, self._lengths_arg)
        return self._lengths

    @property
    def batches(self) -> EpochBatches:
        if self._batches is None:
            self._batches = EpochBatches(self.lengths, self.config, self._capacity())
        return self._batches

    def _capacity(self) -> float:
        c = self.config.plan.replace(degrees=self._degrees).checked(self.cost, self.cluster)   # as the planner sees it
        degree = (c.sp_degree if c.strategy == "static" and c.sp_degree
                  else max(self.cluster.usable_degrees(c.max_degree, c.degrees)))
        return self.cost.group_capacity(degree)

    def _ensure_planner(self) -> AsyncPlanner:
        cursor = (self._epoch, self._index)
        if self._planner is None or self._planner_next != cursor:
            self._close_planner()
            self.batches.check_too_long()
            self._planner = AsyncPlanner(self.batches.iterate(*cursor), self.lengths, self._solve,
                                         lookahead=self.config.lookahead, fallback=self._fallback,
                                         fallback_after=self.config.planner_deadline())
            self._planner_next = cursor
        return self._planner

    def start(self, wait: bool = False) -> None:
        """Start preparing the first step now (e.g. while the model or the optimizer is built); iterating
        does it anyway. Non-blocking by default: the planner process is started and, with ``config.prefetch``,
        the first step is prepared on the loader thread like every later one (its plan made in this process
        while the planner process starts, broadcast, fetched, packed), so the first ``next()`` waits only for
        what is not ready by then. With several ranks, call it on every rank (or on none) at about the same point:
        the preparation's broadcast and load agreement wait for the others (``config.failure_timeout``).
        Errors (a too-long sequence, a bad item) are raised by the first step, on every rank.

        ``wait=True`` (with ``config.prefetch``) returns once the first step is prepared (or has failed), for a
        loop with little left to overlap: the HF Trainer starts its loader a few milliseconds before its first
        step, in set-up that holds the GIL, so the loader thread got little done meanwhile and the first step
        waited for most of it. Every rank must call it: one that waits alone waits ``config.failure_timeout``.
        """
        if self._ahead is None:
            if self.plans_here:
                warm = getattr(self._solve, "warm", None)
                if self.config.prefetch and callable(warm):
                    warm()   # the solver's first-call imports here, not on the loader thread (see PlanBatch.warm)
                if self.config.lookahead > 0:
                    try:
                        self._ensure_planner()   # the planner process starts now, on this thread
                    except Exception:
                        pass   # raised again, on every rank, by the first step
            if self.config.prefetch:
                self._prefetch()
        if wait and self._ahead is not None:
            self._ahead.wait()

    def _planned(self) -> PlannedBatch:
        planner = self._ensure_planner()
        if self._new_solver:
            self._new_solver = False
            planner.set_solver(self._solve, self._fallback)
        result = planner.next()
        if result.batch is not None:
            b = result.batch
            self._planner_next = (b.epoch + 1, 0) if b.last else (b.epoch, b.index + 1)
        s, p = self.stats, self._planner.stats
        s.solve_seconds, s.fallbacks, s.max_ahead = p.solve_seconds, p.fallbacks, p.max_ahead
        return result

    def _payload(self) -> dict[str, Any]:
        """Rank 0's message for this step: the batch and its plan, or the error that stopped planning."""
        where = {"epoch": self._epoch, "index": self._index}
        try:
            result = self._planned()
        except Exception as exc:   # lengths or batching failed before a solve could start
            return {**where, "error": f"{type(exc).__name__}: {exc}"}
        if result.error is not None:
            return {**where, "error": result.error}
        b = result.batch
        # a few flat arrays (every rank rebuilds it as columns, not one dict per group); its meta stays here,
        # as it did in the JSON form: a custom planner's meta need not pickle
        plan = {**pack_plan(result.plan), "meta": {}}
        self._fallbacks += bool(result.fallback)   # every rank learns the count with the plan
        return {"epoch": b.epoch, "index": b.index, "last": b.last, "skipped": b.skipped,
                "indices": list(b.indices), "lengths": [int(n) for n in self.lengths[list(b.indices)]],
                "plan": plan, "fallback": result.fallback, "planner_fallbacks": self._fallbacks,
                "fingerprint": self._fingerprint(), "left_out": self.left_out()}

    def _broadcast(self, payload: dict[str, Any] | None) -> dict[str, Any]:
        if self._control is None:
            raise LoaderError("the loader is closed; build a new one to continue")
        box = [payload]
        what = f"waiting for rank 0's plan of global batch {self._index} of epoch {self._epoch}"
        self._control.call(lambda: dist.broadcast_object_list(box, src=0, group=self._control.group), what,
                           LoaderError)
        return box[0]

    # --- iteration (every rank) -----------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        """One epoch from the current position (a resumed loader starts at its next unseen batch)."""
        while True:
            step = self._take()
            yield step
            if step.last:
                return

    def _take(self) -> Step:
        """The next step for the loop, and the one after it set preparing on the loader thread.

        The step's ``plan_wait + load_seconds`` is the time the loop blocked for it: a prefetched step
        counts only what was not ready yet (the load, which comes last, first)."""
        began = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is None:   # the first step without start(), after a resume or an error, or prefetch off: prepared here
            step = self._prepare()
        else:
            step = ahead.result()
            waited = time.perf_counter() - began
            load = min(waited, step.load_seconds)
            self.stats.prefetched += 1
            step = dataclasses.replace(step, plan_wait=waited - load, load_seconds=load)
        epoch, index = (step.epoch + 1, 0) if step.last else (step.epoch, step.index + 1)
        self._position = (epoch, index, step.step + 1)
        s = self.stats
        s.steps += 1
        s.wait_seconds += step.plan_wait + step.load_seconds
        s.max_wait = max(s.max_wait, step.plan_wait + step.load_seconds)
        s.plan_wait_seconds += step.plan_wait
        s.max_plan_wait = max(s.max_plan_wait, step.plan_wait)
        s.load_seconds += step.load_seconds
        if self.config.prefetch:
            self._prefetch()
        return step

    def _prefetch(self) -> None:
        """Prepare the step at the preparation cursor on the loader thread (on a GPU on a side stream)."""
        if self._stream is None and self.device is not None and self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        self._ahead = Prefetch(self._prepare, self._stream)

    def _prepare(self) -> Step:
        """Prepare the step at the preparation cursor (plan, broadcast, fetch, pack, device copies) and advance it."""
        started = time.perf_counter()
        payload = self._payload() if self.plans_here else None
        if self._communicate:
            payload = self._broadcast(payload)
        wait = time.perf_counter() - started
        if "error" in payload:
            self._close_planner()
            raise LoaderError(f"planning global batch {payload['index']} of epoch {payload['epoch']} failed on "
                              f"rank 0: {payload['error']}")
        if (payload["epoch"], payload["index"]) != (self._epoch, self._index):
            raise LoaderError(f"rank {self.rank} expected batch {self._index} of epoch {self._epoch} but rank 0 "
                              f"sent batch {payload['index']} of epoch {payload['epoch']}: were all ranks resumed "
                              f"from the same state?")
        self._digest, self._left_out = payload["fingerprint"], payload["left_out"]
        plan = unpack_plan(payload["plan"])
        plan = dataclasses.replace(plan, meta={**plan.meta, "planner_fallbacks": payload["planner_fallbacks"]})
        indices, lengths = tuple(payload["indices"]), tuple(payload["lengths"])
        loaded = time.perf_counter()
        shards, failure, supervised = [], None, 0
        try:
            for m, mb in enumerate(plan.micro_batches):
                group = mb.group_of_rank(self.rank)
                if group is not None:
                    shards.append(shard_group(self._fetch, m, group, self.rank, indices, lengths, self.device,
                                              self.pool))
            supervised = self._supervised(plan, shards, indices)
        except Exception as exc:
            if self._control is not None:
                failure = error_line(exc)   # named with the batch and the rank by the agreement below
            elif isinstance(exc, LoaderError):
                raise
            else:   # the dataset's own error (I/O, decoding): name where it happened
                raise LoaderError(f"loading global batch {self._index} of epoch {self._epoch} "
                                  f"failed: {type(exc).__name__}: {exc}") from None
        if self._control is not None:   # a bad item (or a hung read) on one rank stops every rank with the same error
            # the same all-reduce sums the global batch's supervised targets (each group counted by its first rank)
            supervised = self._control.check(failure, what=f"loading global batch {self._index} of epoch "
                                             f"{self._epoch}", error=LoaderError, count=supervised)
        load = time.perf_counter() - loaded
        step = Step(epoch=self._epoch, index=self._index, step=self._step, plan=plan, indices=indices,
                    lengths=lengths, num_tokens=sum(lengths), loss_tokens=supervised,
                    micro_batches=tuple(shards), last=payload["last"], plan_wait=wait, load_seconds=load,
                    fallback=payload["fallback"], sharding=self.sharding)
        self._epoch, self._index = (self._epoch + 1, 0) if step.last else (self._epoch, self._index + 1)
        self._step += 1
        s = self.stats
        s.skipped_too_long = payload["skipped"]
        s.prepare_plan_seconds += wait
        s.prepare_load_seconds += load
        return step

    def _fetch(self, index: int) -> Row:
        return read_row(read_item(self.dataset, index), index, self.vocab_size)

    def _supervised(self, plan: Plan, shards: list, indices: Sequence[int]) -> int:
        """This rank's part of the global batch's supervised-target count: the groups it leads (first rank),
        whose rows it fetched; summed over the ranks by the load agreement. A process standing in for one
        rank of a bigger cluster has no peers to count the rest: it reads the other groups' rows too."""
        if self._communicate:
            return sum(s.supervised for s in shards if s.local_rank == 0)
        others = [indices[i] for mb in plan.micro_batches for g in mb.groups if self.rank not in g.ranks
                  for i in g.seq_ids]
        return sum(s.supervised for s in shards) + sum(self._fetch(i).supervised for i in others)

    def num_batches(self, epoch: int | None = None) -> int:
        """Global batches in ``epoch`` (default: the current one). Needs the lengths on this rank, so it
        is a method rather than ``__len__``, which ``list(loader)`` would call on every rank."""
        return self.batches.count(self._position[0] if epoch is None else epoch)

    # --- resume ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the next unseen batch. JSON-safe; identical on every rank."""
        epoch, index, step = self._position   # the next step the loop has not seen (one may be prepared already)
        state = {"version": STATE_VERSION, "epoch": epoch, "index": index, "step": step,
                 "num_sequences": len(self.dataset), "batching": self.config.batching_key(),
                 "world_size": self.cluster.num_gpus}
        if self._digest is not None:   # rank 0's digest of the lengths, sent with every plan: same on every rank
            state["fingerprint"] = self._digest
        if self._left_out is not None:
            state["left_out"] = self._left_out
        return state

    def left_out(self) -> list[int] | None:
        """``[count, crc32]`` of the sequences every epoch leaves out as too long (``on_too_long="skip"``; needs
        the lengths: the planning rank). The set follows the largest SP group's capacity (cluster, cost model,
        sharding), and each epoch's batches follow the set: a run resumed on another capacity must match it."""
        return list(self.batches.too_long_digest) if self.config.on_too_long == "skip" else None

    def _fingerprint(self) -> str:
        """The dataset as the batches see it: a digest of every item's length (planning rank only)."""
        if self._own_digest is None:
            raw = np.ascontiguousarray(self.lengths, dtype=np.int64).tobytes()
            self._own_digest = hashlib.sha256(raw).hexdigest()[:32]
        return self._own_digest

    def load_state_dict(self, state: dict[str, Any], *, world_size_change: bool = False) -> None:
        """Continue from ``state``, after checking it: position (non-negative integers, a batch index
        within its epoch), the dataset (size, and a digest of its lengths on the planning rank), the
        batching settings (seed included) and the world size must match the saved run. A mismatch is a
        ``LoaderError``. ``world_size_change=True`` accepts another world (the ``Checkpointer`` checks
        that the epoch's batches do not depend on it). Call it on every rank: the planning rank's checks are
        agreed, so every rank raises the same error or none does."""
        if not isinstance(state, dict):
            raise LoaderError(f"loader state must be a dict, got {type(state).__name__}")
        for key in ("epoch", "index", "step", "num_sequences", "batching"):
            if key not in state:
                raise LoaderError(f"loader state is missing {key!r} (has {sorted(state)})")
        for key in ("epoch", "index", "step", "num_sequences"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LoaderError(f"loader state {key!r} must be an integer >= 0, got {value!r}")
        if not isinstance(state["batching"], dict):
            raise LoaderError(f"loader state 'batching' must be a dict, got {type(state['batching']).__name__}")
        version = state.get("version", STATE_VERSION)    # states saved before the field existed are version 1
        if version != STATE_VERSION:
            raise LoaderError(f"loader state version {version!r} is not the supported {STATE_VERSION} (written by "
                              f"another FlexSP release)")
        saved_world = state.get("world_size")
        if saved_world is not None and (isinstance(saved_world, bool) or not isinstance(saved_world, int)
                                        or saved_world < 1):
            raise LoaderError(f"loader state 'world_size' must be an integer >= 1, got {saved_world!r}")
        left_out = state.get("left_out")
        if left_out is not None and not (isinstance(left_out, list) and len(left_out) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in left_out)):
            raise LoaderError(f"loader state 'left_out' must be [count, crc32] (integers >= 0), got {left_out!r}")
        if state["num_sequences"] != len(self.dataset):
            raise LoaderError(f"the saved state is for a dataset of {state['num_sequences']} sequences, "
                              f"this one has {len(self.dataset)}")
        mine = self.config.batching_key()
        saved = {"drop_last": False, **state["batching"]}   # states saved before drop_last existed kept every batch
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            raise LoaderError(f"batching settings differ from the saved run (saved, now): {diff}; "
                              f"resuming would repeat or lose sequences")
        if saved_world is not None and saved_world != self.cluster.num_gpus and not world_size_change:
            raise LoaderError(f"the saved state is for a world of {saved_world} ranks, this loader plans for "
                              f"{self.cluster.num_gpus}; resume through the Checkpointer (which checks that "
                              f"the batches do not change) or pass world_size_change=True")
        failure = None
        if self.plans_here:   # checks only the planning rank can make, agreed below so that no rank goes on alone
            count = self.batches.count(state["epoch"])
            if state.get("fingerprint") is not None and state["fingerprint"] != self._fingerprint():
                failure = ("the saved state is for another dataset (its lengths differ from this one's, same size); "
                           "resuming would train on other sequences")
            elif state["index"] >= max(count, 1):
                failure = f"loader state index {state['index']} is past epoch {state['epoch']}'s {count} batches"
            elif state.get("left_out") is not None and state["left_out"] != self.left_out():
                failure = (f"the saved run left out {state['left_out'][0]} too-long sequence(s) "
                           f"(on_too_long='skip'); with this cluster and cost model the largest SP group holds "
                           f"a different set ({self.left_out()[0]} left out), so resuming would lose or repeat "
                           f"sequences: resume with the saved capacity, or start a new epoch")
        if self._control is not None:
            self._control.check(failure, what="loading the loader state", error=LoaderError)
        elif failure is not None:
            raise LoaderError(failure)
        self._drop_prefetch()
        self._close_planner()
        self._epoch, self._index, self._step = int(state["epoch"]), int(state["index"]), int(state["step"])
        self._position = (self._epoch, self._index, self._step)

    # --- lifetime -------------------------------------------------------------------------------
    def _drop_prefetch(self) -> None:
        """Let the step being prepared finish and discard it (every rank runs the same preparation, so its
        collectives complete; at worst they end at ``failure_timeout``). Its batch is prepared again later."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        ahead.wait(self.config.failure_timeout + 10.0)
        # prepare from the position handed out again (the planner restarts there: _ensure_planner)
        self._epoch, self._index, self._step = self._position

    def _close_planner(self) -> None:
        if self._planner is not None:
            self._planner.close()
        self._planner, self._planner_next = None, None

    def close(self) -> None:
        """Stop the background planner (a solve in progress finishes in its daemon thread), after the
        step being prepared ahead finishes (call on every rank: its broadcast needs them all)."""
        self._drop_prefetch()
        self._close_planner()
        if self._control is not None:
            self._control.close()
            self._control = None

    def __enter__(self) -> "FlexSPLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_at_exit(loader: "weakref.ref[FlexSPLoader]") -> None:
    """At interpreter exit: close a loader still alive (its prefetch finishes first, then its planner and
    side group go down). A preparation still running after ``EXIT_WAIT_S`` (a peer gone: its collectives
    would wait ``failure_timeout``) is left as it is, so a failed job's exit never waits on a dead rank.
    Errors are logged, never raised: there is no caller left to handle them."""
    live = loader()
    if live is None:
        return
    ahead = live._ahead
    if ahead is not None and not ahead.wait(EXIT_WAIT_S):
        _log.warning("flexsp: the loader's next step was still being prepared %s s into the exit; left as it is",
                     EXIT_WAIT_S)
        return
    try:
        live.close()
    except Exception as exc:
        _log.warning("flexsp: closing the loader at exit failed: %s: %s", type(exc).__name__, exc)
