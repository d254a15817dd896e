"""One JSON record per training step: what the plan predicted beside what every rank measured. Torch-free.

``StepRecorder`` (``recorder.py``) measures each rank's step as a *rank record* (plain numbers);
rank 0 combines the ranks' records with the plan into a *step record* (``build_record``), one JSON
line of ``RECORDS`` in the run directory. Definitions, so that a reader knows what each figure is:

* ``seconds``: the step on the slowest rank, from the executor's entry (checks included) to the end
  of its optimizer step. ``plan_wait`` / ``load_seconds``: the time the loop blocked for the step's plan
  and for its fetch + pack (slowest rank); with the loader's prefetch only what was not ready when the
  loop asked (``flexsp.data.FlexSPLoader``). ``loop_seconds = seconds + plan_wait + load_seconds``.
* Micro-batch ``wall``: per rank, start to end of its forward + backward. Group ``measured``: the
  group's own compute where a rank's busy time is measurable (the main thread's CPU time on a CPU run
  with one intra-op thread: blocked collectives cost no CPU), else the shortest member's wall time
  (on a GPU under FSDP's per-layer collectives this bounds the group's time from above).
* ``idle_seconds`` per rank: wall time of micro-batches it sat out (a dummy shard) plus, where busy
  time is known, the wall time of its own micro-batches it spent waiting in collectives (on a shared,
  oversubscribed CPU, time the process waited for a core counts here too).
* ``tokens``: every real token of the global batch (what is computed: ``tokens_per_s`` counts these);
  ``supervised_tokens``: the targets that carry loss (a ``labels`` column or TRL's masks; without them every
  token but each sequence's last), the denominator of the step's loss (``StepResult.loss_tokens``).
* ``model_flops``: ``6 P_linear s + 6 layers (heads x head_dim) s^2`` per sequence of ``s`` tokens
  (forward + backward = 3x forward; causal attention 2 s^2 width per layer forward), the
  convention of ``flexsp.plan.analytic``. ``mfu = model_flops / (loop_seconds x world x peak_flops)``.
* ``planned_*``: the recorder's current cost model (refits included) on this step's plan;
  ``plan_predicted`` is the planner's own ``Plan.predicted_time``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import fmean, median   # not numpy's: a record has many tiny lists, and numpy's call costs ~50 us each
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from flexsp.errors import FlexSPError
from flexsp.plan.cost import CostModel
from flexsp.plan.specs import GPUS, ModelSpec
from flexsp.plan.types import Plan

RECORDS = "records.jsonl"    # one step record per line
RUN = "run.json"             # the run's description: world, model, peak, starting cost model
REFITS = "refits.jsonl"      # one line per cost model the refit handed to the planner

# every key of a step record (values may be None only where STEP_OPTIONAL says so)
STEP_FIELDS = ("step", "epoch", "index", "time", "world", "strategy", "fallback", "sequences", "tokens",
               "supervised_tokens",
               "seconds", "check_seconds", "tail_seconds", "plan_wait", "load_seconds", "loop_seconds",
               "loader_fraction", "idle_seconds", "idle_fraction", "tokens_per_s", "model_flops", "mfu",
               "peak_flops", "planned_seconds", "plan_predicted", "planned_error", "peak_memory_bytes",
               "memory_kind", "max_tokens_per_gpu", "token_capacity", "cost_version", "probe_seconds",
               "micro_batches", "ranks")
STEP_OPTIONAL = ("epoch", "index", "mfu", "peak_flops", "model_flops", "peak_memory_bytes", "supervised_tokens")
LATER_FIELDS = ("supervised_tokens",)   # added since records were first written: None in an older record
GROUP_FIELDS = ("ranks", "degree", "lengths", "tokens", "planned", "measured", "wall", "busy")
RANK_FIELDS = ("rank", "seconds", "check_seconds", "tail_seconds", "plan_wait", "load_seconds", "idle_seconds",
               "peak_memory_bytes", "probe_seconds", "micro_batches")
RANK_MB_FIELDS = ("start", "forward", "end", "busy", "group", "tokens")

# bf16 dense peak FLOP/s by device-name fragment (lower case); a user-given peak wins
PEAK_FLOPS: Mapping[str, float] = {"h200": 989e12, "h100": GPUS["h100-80gb"].peak_flops,
                                   "a100": GPUS["a100-40gb"].peak_flops, "l40s": 362e12, "a10g": 125e12,
                                   "mi300x": 1307e12, "b200": 2250e12}


class TelemetryError(FlexSPError):
    """A run directory or record that cannot be read or written."""


def peak_flops(device_name: str | None, given: float | None = None) -> float | None:
    """``given`` if set, else the table's entry whose key is in ``device_name``; None if unknown (e.g. a CPU)."""
    if given is not None:
        if not (isinstance(given, (int, float)) and math.isfinite(given) and given > 0):
            raise TelemetryError(f"peak_flops must be a positive number of FLOP/s, got {given!r}")
        return float(given)
    name = (device_name or "").lower()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def model_flops(spec: ModelSpec, lengths: Iterable[int]) -> float:
    """Training FLOPs (forward + backward) of one step over sequences of ``lengths`` tokens (module docstring;
    ``ModelSpec.training_flops``)."""
    return spec.training_flops(lengths)


def group_measured(walls: Sequence[float], busy: Sequence[float | None]) -> float:
    """A group's measured seconds from its members' (module docstring): busy if known on all, else the least wall."""
    return float(median(busy)) if busy and all(b is not None for b in busy) else float(min(walls))


def build_record(plan: Plan, lengths: Sequence[int], ranks: Sequence[Mapping[str, Any]], cost: CostModel, *,
                 meta: Mapping[str, Any], spec: ModelSpec | None = None, peak: float | None = None,
                 cost_version: int = 0, now: float = 0.0) -> dict[str, Any]:
    """The step record of ``plan`` from every rank's record (``ranks[r]`` is rank ``r``'s)."""
    world = len(ranks)
    mbs = []
    for m, mb in enumerate(plan.micro_batches):
        groups = []
        for j, g in enumerate(mb.groups):
            members = [ranks[r]["micro_batches"][m] for r in g.ranks]
            walls = [x["end"] - x["start"] for x in members]
            busy = [x["busy"] for x in members]
            glen = [int(lengths[s]) for s in g.seq_ids]
            groups.append({"ranks": list(g.ranks), "degree": g.degree, "ring": g.ring, "lengths": glen,
                           "tokens": int(sum(glen)), "planned": cost.group_time(glen, g.degree),
                           "measured": group_measured(walls, busy), "wall": max(walls),
                           "busy": None if any(b is None for b in busy) else float(median(busy))})
        walls = [r["micro_batches"][m]["end"] - r["micro_batches"][m]["start"] for r in ranks]
        mbs.append({"planned": max(g["planned"] for g in groups), "measured": max(walls), "groups": groups})
    seconds = max(r["seconds"] for r in ranks)
    wait = max(r["plan_wait"] for r in ranks)
    load = max(r["load_seconds"] for r in ranks)
    loop = seconds + wait + load
    tokens = int(sum(int(n) for n in lengths))
    flops = model_flops(spec, lengths) if spec is not None else None
    planned = float(sum(mb["planned"] for mb in mbs))
    measured = float(sum(mb["measured"] for mb in mbs))
    memory = [r["peak_memory_bytes"] for r in ranks if r["peak_memory_bytes"] is not None]
    loads = [sum(int(lengths[s]) for s in g.seq_ids) / g.degree for mb in plan.micro_batches for g in mb.groups]
    idle = [r["idle_seconds"] for r in ranks]
    record = {
        "step": meta.get("step"), "epoch": meta.get("epoch"), "index": meta.get("index"), "time": now,
        "world": world, "strategy": plan.strategy, "fallback": bool(meta.get("fallback", False)),
        "sequences": len(lengths), "tokens": tokens, "supervised_tokens": meta.get("supervised_tokens"),
        "seconds": seconds,
        "check_seconds": max(r["check_seconds"] for r in ranks), "tail_seconds": max(r["tail_seconds"] for r in ranks),
        "plan_wait": wait, "load_seconds": load, "loop_seconds": loop, "loader_fraction": (wait + load) / loop,
        "idle_seconds": float(fmean(idle)), "idle_fraction": float(fmean(idle)) / seconds,
        "tokens_per_s": tokens / loop, "model_flops": flops,
        "mfu": None if flops is None or peak is None else flops / (loop * world * peak), "peak_flops": peak,
        "planned_seconds": planned, "plan_predicted": plan.predicted_time,
        "planned_error": (planned - measured) / measured if measured > 0 else None,
        "peak_memory_bytes": max(memory) if memory else None, "memory_kind": meta.get("memory_kind", "none"),
        "max_tokens_per_gpu": max(loads), "token_capacity": cost.token_capacity, "cost_version": cost_version,
        "probe_seconds": max(r["probe_seconds"] for r in ranks), "micro_batches": mbs, "ranks": list(ranks),
    }
    return record


def group_errors(record: Mapping[str, Any]) -> np.ndarray:
    """Relative errors (planned - measured) / measured of every group of a step record."""
    return np.asarray([(g["planned"] - g["measured"]) / g["measured"] for mb in record["micro_batches"]
                       for g in mb["groups"] if g["measured"] > 0], dtype=np.float64)


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a run directory, in order; a ``TelemetryError`` naming the file and line if unreadable."""
    path = Path(run_dir) / RECORDS
    if not Path(run_dir).is_dir():
        raise TelemetryError(f"{run_dir} is not a run directory (no such directory)")
    if not path.is_file():
        raise TelemetryError(f"{run_dir} holds no {RECORDS}: was the run started with flexsp.telemetry.Telemetry?")
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                if n > 1 and not line.endswith("\n"):
                    break   # the last line of a run killed mid-write
                raise TelemetryError(f"{path} line {n} is not JSON: {exc.msg}") from None
            for key in LATER_FIELDS:
                record.setdefault(key, None)
            missing = [k for k in STEP_FIELDS if k not in record]
            if missing:
                raise TelemetryError(f"{path} line {n} lacks {', '.join(missing)}: not a FlexSP step record")
            out.append(record)
    if not out:
        raise TelemetryError(f"{path} holds no step record yet")
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
