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
import os
import sys
from itertools import count
from pathlib import Path
from statistics import fmean, median   # not numpy's: a record has many tiny lists, and numpy's call costs ~50 us each
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn, Sequence

import numpy as np

from flexsp.errors import FlexSPError
from flexsp.inputs import INT64_MAX, DuplicateKey, distinct_keys, integer, limit, number, raise_hint, read_json, too_large
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


# --- reading a run directory back: untrusted input, checked as it is read --------------------------
# What each field may hold: "n" a finite number >= 0, "p" one > 0, "r" any finite number, "i" an integer
# >= 0, "I" one >= 1, "s" a string, "b" a boolean, "L" a list; a trailing "?" also allows null.
STEP_KINDS = {"step": "i", "epoch": "i?", "index": "i?", "time": "r", "world": "I", "strategy": "s",
              "fallback": "b", "sequences": "I", "tokens": "I", "supervised_tokens": "i?", "seconds": "p",
              "check_seconds": "n", "tail_seconds": "n", "plan_wait": "n", "load_seconds": "n", "loop_seconds": "p",
              "loader_fraction": "n", "idle_seconds": "n", "idle_fraction": "n", "tokens_per_s": "n",
              "model_flops": "n?", "mfu": "n?", "peak_flops": "p?", "planned_seconds": "n", "plan_predicted": "n",
              "planned_error": "r?", "peak_memory_bytes": "n?", "memory_kind": "s", "max_tokens_per_gpu": "n",
              "token_capacity": "n", "cost_version": "i", "probe_seconds": "n", "micro_batches": "L", "ranks": "L"}
MICRO_BATCH_KINDS = {"planned": "n", "measured": "p", "groups": "L"}
GROUP_KINDS = {"ranks": "L", "degree": "I", "lengths": "L", "tokens": "i", "planned": "n", "measured": "n",
               "wall": "n", "busy": "n?"}
RANK_KINDS = {"rank": "i", "seconds": "n", "check_seconds": "n", "tail_seconds": "n", "plan_wait": "n",
              "load_seconds": "n", "idle_seconds": "n", "peak_memory_bytes": "n?", "probe_seconds": "n",
              "micro_batches": "L"}
RANK_MB_KINDS = {"start": "n", "forward": "n", "end": "n", "busy": "n?", "group": "i?", "tokens": "i"}
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
_MAX = sys.float_info.max
_MISSING = object()   # of no kind
_NUMBER = (int, float)   # exactly JSON's numbers (a bool is neither): tested by type, the hot path of a long run
_KINDS: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: type(v) in _NUMBER and 0 <= v <= _MAX, "p": lambda v: type(v) in _NUMBER and 0 < v <= _MAX,
    "r": lambda v: type(v) in _NUMBER and -_MAX <= v <= _MAX, "i": lambda v: type(v) is int and 0 <= v <= INT64_MAX,
    "I": lambda v: type(v) is int and 1 <= v <= INT64_MAX, "s": lambda v: type(v) is str,
    "b": lambda v: type(v) is bool, "L": lambda v: type(v) is list}


def _or_null(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


_KINDS.update({f"{k}?": _or_null(ok) for k, ok in list(_KINDS.items())})


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "a number")


def _name(*path: str | int) -> str:
    """``("ranks", 3, "busy")`` as ``ranks[3].busy``: built only for a message, not for every field read."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "the step record"


def _refuse(value: Any, kind: str, what: str) -> NoReturn:
    """The ``TelemetryError`` saying why ``value`` is not of ``kind`` (a code of STEP_KINDS)."""
    kind = kind[0]
    if kind in "sbL":
        name = {"s": "a string", "b": "a boolean", "L": "an array"}[kind]
        raise TelemetryError(f"{what} must be {name}, got {_json_type(value)}")
    if isinstance(value, bool) or not isinstance(value, _NUMBER):   # no repr: a string may be megabytes
        raise TelemetryError(f"{what} must be {'an integer' if kind in 'iI' else 'a number'}, got {_json_type(value)}")
    if kind in "iI":
        integer(value, what, TelemetryError, minimum=1 if kind == "I" else 0)
    number(value, what, TelemetryError, minimum=None if kind == "r" else 0.0, positive=kind == "p")
    raise TelemetryError(f"{what} is out of range")


def _fields(value: Any, kinds: Mapping[str, str], *path: str | int) -> None:
    """``value`` is an object holding every key of ``kinds``, each of its kind."""
    if type(value) is not dict:
        raise TelemetryError(f"{_name(*path)} must be an object, got {_json_type(value)}")
    for key, kind in kinds.items():
        if not _KINDS[kind](value.get(key, _MISSING)):
            missing = [k for k in kinds if k not in value]
            if missing:
                raise TelemetryError(f"{_name(*path)} lacks {', '.join(missing)}")
            _refuse(value[key], kind, _name(*path, key))


def check_record(record: dict[str, Any]) -> None:
    """Every field has its type and range (``STEP_KINDS`` and below) and the indices agree (a rank record per
    rank of ``world``, each with the step's micro-batches, groups and ranks that exist), so that reading a
    record can only fail here, with a message naming the field."""
    _fields(record, STEP_KINDS)
    world, mbs, ranks = record["world"], record["micro_batches"], record["ranks"]
    if world > limit("gpus"):
        raise TelemetryError(too_large("world", world, "gpus"))
    if record["mfu"] is not None and record["peak_flops"] is None:
        raise TelemetryError("mfu is given without peak_flops")
    if not mbs:
        raise TelemetryError("micro_batches is empty: a step runs at least one")
    if len(ranks) != world:
        raise TelemetryError(f"world is {world} but ranks holds {len(ranks)} rank records")
    for m, mb in enumerate(mbs):
        _fields(mb, MICRO_BATCH_KINDS, "micro_batches", m)
        if not mb["groups"]:
            raise TelemetryError(f"micro_batches[{m}].groups is empty")
        for j, group in enumerate(mb["groups"]):
            _fields(group, GROUP_KINDS, "micro_batches", m, "groups", j)
            if not all(type(r) is int and 0 <= r < world for r in group["ranks"]):
                raise TelemetryError(f"{_name('micro_batches', m, 'groups', j, 'ranks')} must hold ranks "
                                     f"0..{world - 1} (integers)")
            if not all(type(n) is int and 0 <= n <= INT64_MAX for n in group["lengths"]):
                raise TelemetryError(f"{_name('micro_batches', m, 'groups', j, 'lengths')} must hold integers >= 0")
    for i, rank in enumerate(ranks):
        _fields(rank, RANK_KINDS, "ranks", i)
        if rank["rank"] != i:
            raise TelemetryError(f"ranks[{i}].rank is {rank['rank']}: ranks must be in order 0..{world - 1}")
        if len(rank["micro_batches"]) != len(mbs):
            raise TelemetryError(f"ranks[{i}].micro_batches holds {len(rank['micro_batches'])} micro-batches, "
                                 f"the step {len(mbs)}")
        for m, mb in enumerate(rank["micro_batches"]):
            _fields(mb, RANK_MB_KINDS, "ranks", i, "micro_batches", m)
            if mb["group"] is not None and mb["group"] >= len(mbs[m]["groups"]):
                raise TelemetryError(f"ranks[{i}].micro_batches[{m}].group is {mb['group']} but micro-batch {m} "
                                     f"has {len(mbs[m]['groups'])} groups")


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON-lines file, read within caps so that no file can
    hang the reader or exhaust memory: a regular file, at most ``text_bytes`` in all and ``json_bytes`` a line
    (``flexsp.inputs``). A last line cut short (a run killed mid-write) ends the file."""
    line_cap, file_cap = limit("json_bytes"), limit("text_bytes")
    if not path.is_file():
        raise TelemetryError(f"cannot read {path}: not a regular file")
    try:
        if path.stat().st_size > file_cap:
            raise TelemetryError(_over(str(path), "text_bytes"))
        f = path.open("rb")
    except OSError as exc:
        raise TelemetryError(f"cannot read {path}: {exc.strerror or exc}") from None
    with f:
        read = 0
        for n in count(1):
            try:
                raw = f.readline(line_cap + 1)
            except OSError as exc:
                raise TelemetryError(f"cannot read {path}: {exc.strerror or exc}") from None
            read += len(raw)
            if read > file_cap:   # grew while read
                raise TelemetryError(_over(str(path), "text_bytes"))
            if len(raw) > line_cap:
                raise TelemetryError(_over(f"{path} line {n}", "json_bytes"))
            if not raw:
                return
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"), object_pairs_hook=distinct_keys)
            except DuplicateKey as exc:   # json would keep the later value silently
                raise TelemetryError(f"{path} line {n} has the key {exc.args[0]!r} twice in one object; which value "
                                     f"counts would be a guess") from None
            except (ValueError, RecursionError) as exc:   # not UTF-8, not JSON, digits beyond the limit, too deep
                if n > 1 and not raw.endswith(b"\n"):
                    return
                reason = ("is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else
                          "is nested too deeply" if isinstance(exc, RecursionError) else
                          f"is not JSON: {getattr(exc, 'msg', exc)}")
                raise TelemetryError(f"{path} line {n} {reason}") from None
            yield n, value


def _over(what: str, cap: str) -> str:
    return f"{what} is longer than the cap of {limit(cap)} bytes; {raise_hint(cap)}"


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The step records of a run directory, in order, each checked by ``check_record``; a ``TelemetryError``
    naming the file, line and field if one is unreadable (the files of a run directory are untrusted)."""
    path = Path(run_dir) / RECORDS
    if not Path(run_dir).is_dir():
        raise TelemetryError(f"{run_dir} is not a run directory (no such directory)")
    if not os.path.lexists(path):
        raise TelemetryError(f"{run_dir} holds no {RECORDS}: was the run started with flexsp.telemetry.Telemetry?")
    out = []
    for n, record in _json_lines(path):
        if not isinstance(record, dict):
            raise TelemetryError(f"{path} line {n} is {_json_type(record)}, not a step record (a JSON object)")
        for key in LATER_FIELDS:
            record.setdefault(key, None)
        missing = [k for k in STEP_FIELDS if k not in record]
        if missing:
            raise TelemetryError(f"{path} line {n} lacks {', '.join(missing)}: not a FlexSP step record")
        try:
            check_record(record)
        except TelemetryError as exc:
            raise TelemetryError(f"{path} line {n}: {exc}") from None
        out.append(record)
    if not out:
        raise TelemetryError(f"{path} holds no step record yet")
    return out


def read_refits(run_dir: str | Path) -> list[dict[str, Any]]:
    """The refits of a run directory (none without ``REFITS``), each an object with its integer ``step``."""
    path = Path(run_dir) / REFITS
    if not os.path.lexists(path):
        return []
    out = []
    for n, refit in _json_lines(path):
        if type(refit) is not dict or not _KINDS["i"](refit.get("step")):
            raise TelemetryError(f"{path} line {n} is not a refit: a JSON object with an integer step >= 0")
        out.append(refit)
    return out


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """The run's description (``RUN``; empty without one), read by ``flexsp.inputs.read_json`` within its caps."""
    path = Path(run_dir) / RUN
    if not os.path.lexists(path):
        return {}
    run = read_json(path, "run description", TelemetryError)
    if not isinstance(run, dict):
        raise TelemetryError(f"run description {path} is {_json_type(run)}, not a JSON object")
    if run.get("device") is not None and not isinstance(run["device"], str):
        raise TelemetryError(f"run description {path}: device must be a string, got {_json_type(run['device'])}")
    return run
