"""Measured presets: cost models fitted by ``flexsp profile`` on a real GPU, shipped by name with their provenance.

Each JSON file in ``flexsp/plan/measured/`` is one preset (``h200-llama3-8b.json`` is named
``h200-llama3-8b``); adding a GPU is dropping its file there, no code change. A file is a small
wrapper around the ``flexsp profile`` output, written by ``python -m flexsp.plan.measured_presets``::

    {"format": "flexsp measured preset", "version": 2, "name": "h200-llama3-8b",
     "description": "...", "provenance": {"driver": "...", "command": "flexsp profile ...", ...},
     "profile": { the flexsp profile JSON as written, with its meta }}

Version 2 adds the per-kind compute fit of a model with windowed, chunked or linear-attention layers
(``flexsp profile`` times a layer of each kind apart): ``profile.meta.kinds``, one record per kind
(``mixer``, ``size``, ``layers``, ``work``: ``square`` / ``pairs`` / ``none``, one layer's ``alpha``,
``alpha2``, ``beta1``, its fit errors and points, ``estimated`` where the kind was not timed), whose sums are
the profile's ``alpha1``, ``window_alpha`` and ``chunk_alpha``. Version 1 files (no kinds) load unchanged;
a version 1 file carrying ``kinds`` is refused (it was not written by a reader that checks them).

The profile's ``meta`` holds the device, torch version, date, the model shape, the compute fit and
its error, the memory measurement, and which parts were assumed (``meta["assumed"]``: one GPU
measures no all-to-all, so an ``--interconnect`` preset's documented figures stand in). The wrapper
adds what the profile cannot know about itself: the driver and the command that made it.

Loading a preset for a setting (``measured_cost_model``) keeps the measured compute and recomputes
what depends on the setting, the way the analytic and paper presets do: the token capacity from the
measured activation bytes per token, the device memory and the model states of ``sharding`` over
``num_gpus`` (``flexsp.plan.memory``), and the assumed all-to-all table for every degree with a tile
on nodes of ``gpus_per_node`` (``flexsp.plan.analytic.alltoall_bandwidth`` at the recorded figures).
The context changes no capacity (rotary positions have no parameters, and attention keeps no s^2
activations); a context beyond the longest measured sequence is noted as an extrapolation of the fit.

Files are untrusted input: read by ``flexsp.inputs.load_json`` (no code runs), at most
``MAX_PRESET_BYTES``, and anything malformed or of another format version is refused with a
``CostModelError`` naming the file and what would be valid. Torch-free.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from flexsp.errors import CostModelError
from flexsp.inputs import integer, load_json, number, write_text
from flexsp.plan.analytic import alltoall_bandwidth, alltoall_degrees, alltoall_replication
from flexsp.plan.cost import CostModel
from flexsp.plan.layers import MIXERS, SIZED, LayerKind
from flexsp.plan.memory import check as check_sharding
from flexsp.plan.memory import model_state_bytes, token_capacity
from flexsp.plan.specs import SHAPE_FIELDS, ModelSpec

FOLDER = Path(__file__).resolve().parent / "measured"
FORMAT = "flexsp measured preset"
VERSION = 2                         # written; 2 added profile.meta.kinds (per layer kind)
VERSIONS = (1, 2)                   # read
MAX_PRESET_BYTES = 1 << 20          # a preset is a few KiB; anything near this is not one
MAX_KINDS = 64                      # layer kinds one preset may record (models have 1 to 4)
MAX_POINTS = 256                    # fit points one kind may record
NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{0,63}$")
REQUIRED_PROVENANCE = ("driver", "command")


def preset_files(folder: Path | None = None) -> dict[str, Path]:
    """Name -> file of every measured preset in ``folder`` (default: the package's ``measured/``)."""
    folder = FOLDER if folder is None else Path(folder)
    return {p.stem: p for p in sorted(folder.glob("*.json"))} if folder.is_dir() else {}


def measured_names(folder: Path | None = None) -> tuple[str, ...]:
    return tuple(preset_files(folder))


def load_preset(name: str, folder: Path | None = None) -> dict[str, Any]:
    """The checked document of preset ``name`` (``CostModelError`` if unknown, malformed or foreign)."""
    files = preset_files(folder)
    if name not in files:
        raise CostModelError(f"unknown measured preset {name!r}; measured presets: {', '.join(files) or 'none'}")
    return read_preset(files[name])


def read_preset(path: str | Path) -> dict[str, Any]:
    """Read and check one preset file; its ``name`` must equal the file's stem."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CostModelError(f"cannot read measured preset {path}: {exc.strerror or exc}") from None
    if size > MAX_PRESET_BYTES:
        raise CostModelError(f"measured preset {path} has {size} bytes, over the {MAX_PRESET_BYTES} a preset may "
                             f"have; a preset is a flexsp profile JSON in a small wrapper")
    return load_json(path, "measured preset", CostModelError, lambda data: check_preset(data, path.stem))


def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CostModelError(f"{where}{key} must be a {names}, got {value!r}")
    return value


def check_preset(data: Any, stem: str) -> dict[str, Any]:
    """``data`` if it is a version-``VERSION`` preset named ``stem`` whose profile builds a cost model
    and records what a measured preset must show (device, torch, date, fit error, memory)."""
    if not isinstance(data, Mapping):
        raise CostModelError(f"a measured preset must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CostModelError(f"not a measured preset: format is {data.get('format')!r}, expected {FORMAT!r} "
                             f"(wrap a flexsp profile JSON with python -m flexsp.plan.measured_presets)")
    version = data.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise CostModelError(f"measured preset format version {version!r} is not supported; this "
                             f"FlexSP reads versions {', '.join(map(str, VERSIONS))}")
    name = _field(data, "name", str, "")
    if not NAME.match(name) or name != stem:
        raise CostModelError(f"measured preset name {name!r} must be lowercase letters, digits, '.' or '-' and "
                             f"equal the file name ({stem!r})")
    provenance = _field(data, "provenance", dict, "")
    for key in REQUIRED_PROVENANCE:
        _field(provenance, key, str, "provenance.")
    profile = _field(data, "profile", dict, "")
    meta = _field(profile, "meta", dict, "profile.")
    if meta.get("source") != "flexsp profile":
        raise CostModelError(f"profile.meta.source is {meta.get('source')!r}; a measured preset wraps the output "
                             f"of flexsp profile")
    for key in ("device", "torch", "date"):
        _field(meta, key, str, "profile.meta.")
    _field(meta, "model", dict, "profile.meta.")
    compute = _field(meta, "compute", dict, "profile.meta.")
    memory = _field(meta, "memory", dict, "profile.meta.")
    for key in ("mean_abs_rel_error", "max_abs_rel_error"):
        number(compute.get(key), f"profile.meta.compute.{key}", CostModelError)
    for key in ("bytes_per_token", "memory_bytes", "usable_fraction"):
        number(memory.get(key), f"profile.meta.memory.{key}", CostModelError, positive=True)
    number(meta.get("params"), "profile.meta.params", CostModelError, positive=True)
    lengths = _field(meta, "lengths", list, "profile.meta.")
    for n in lengths:
        integer(n, "profile.meta.lengths entries", CostModelError)
    ModelSpec(**{k: meta["model"].get(k) for k in SHAPE_FIELDS}, name=str(meta["model"].get("name", "custom")))
    estimates = meta.get("estimates", [])
    if not isinstance(estimates, list) or not all(isinstance(e, str) for e in estimates):
        raise CostModelError(f"profile.meta.estimates must be a list of strings, got {estimates!r:.80}")
    _check_comm(meta)
    cost = CostModel.from_dict(profile)        # the coefficients themselves: every CostModel check
    if "kinds" in meta:
        if version < 2:
            raise CostModelError("profile.meta.kinds (per layer kind fits) needs measured preset format version 2, "
                                 "the file says version 1")
        _check_kinds(meta["kinds"], cost, int(meta["model"].get("layers")))
    return dict(data)


def _check_kinds(kinds: Any, cost: CostModel, layers: int) -> None:
    """``profile.meta.kinds``: a short list of per-kind fits that cover the model's layers and agree with the
    profile's window / chunk terms (one-line ``CostModelError`` naming the entry and field otherwise)."""
    if not isinstance(kinds, list) or not 1 <= len(kinds) <= MAX_KINDS:
        raise CostModelError(f"profile.meta.kinds must be a list of 1 to {MAX_KINDS} per-kind fits, got "
                             f"{type(kinds).__name__}{f' of {len(kinds)}' if isinstance(kinds, list) else ''}")
    total = 0
    for i, kind in enumerate(kinds):
        where = f"profile.meta.kinds[{i}]."
        if not isinstance(kind, dict):
            raise CostModelError(f"profile.meta.kinds[{i}] must be an object, got {type(kind).__name__}")
        mixer = _field(kind, "mixer", str, where)
        if mixer not in MIXERS:
            raise CostModelError(f"{where}mixer must be one of {', '.join(MIXERS)}, got {mixer!r:.40}")
        size = integer(kind.get("size"), f"{where}size", CostModelError, minimum=0)
        LayerKind(mixer, size)                  # a window or chunk needs its size, the others none
        total += integer(kind.get("layers"), f"{where}layers", CostModelError, maximum=2**20)
        work = _field(kind, "work", str, where)
        allowed = ("pairs", "square") if mixer in SIZED else ("square",) if mixer == "full" else ("none",)
        if work not in allowed:
            raise CostModelError(f"{where}work of a {mixer} layer must be {' or '.join(allowed)}, got {work!r:.40}")
        for key in ("alpha", "alpha2", "beta1"):
            number(kind.get(key), f"{where}{key}", CostModelError)
        estimated = kind.get("estimated")
        if estimated is not None and not isinstance(estimated, str):
            raise CostModelError(f"{where}estimated must be a string (why the kind was not timed), got "
                                 f"{estimated!r:.40}")
        if estimated is None:
            for key in ("mean_abs_rel_error", "max_abs_rel_error"):
                number(kind.get(key), f"{where}{key}", CostModelError)
        points = _field(kind, "points", list, where)
        if len(points) > MAX_POINTS:
            raise CostModelError(f"{where}points has {len(points)} entries, more than the {MAX_POINTS} a kind may "
                                 f"record")
        if work == "pairs" and size not in getattr(cost, f"{mixer}_alpha"):
            raise CostModelError(f"{where}: a {mixer} {size} fitted by its pairs needs profile.{mixer}_alpha[{size}], "
                                 f"which the profile lacks")
    if total != layers:
        raise CostModelError(f"profile.meta.kinds cover {total} layers but the model has {layers}")


def _check_comm(meta: Mapping[str, Any]) -> None:
    """The communication records a preset reads: measured fits (by degree) and the assumed interconnect."""
    for key in ("comm", "assumed", "ring"):
        if meta.get(key) is not None:
            _field(meta, key, dict, "profile.meta.")
    fits = (meta.get("comm") or {}).get("fits", {})
    if not isinstance(fits, dict) or not all(isinstance(d, str) and d.isdigit() and len(d) < 12 for d in fits):
        raise CostModelError(f"profile.meta.comm.fits must map SP degrees to fits, got {fits!r:.80}")
    assumed = meta.get("assumed")
    if assumed:
        parts = _field(assumed, "parts", list, "profile.meta.assumed.")
        figures = _field(assumed, "figures", dict, "profile.meta.assumed.")
        for key in ("interconnect", "source"):
            _field(assumed, key, str, "profile.meta.assumed.")
        if not all(isinstance(part, str) for part in parts):
            raise CostModelError(f"profile.meta.assumed.parts must be a list of names, got {parts!r:.80}")
        for key in ("intra_node_bandwidth", "inter_node_bandwidth"):
            number(figures.get(key), f"profile.meta.assumed.figures.{key}", CostModelError, positive=True)
        number(figures.get("latency"), "profile.meta.assumed.figures.latency", CostModelError)


def measured_cost_model(name: str, context: int = 384 * 1024, num_gpus: int = 64, *, sharding: str = "full",
                        gpus_per_node: int = 8, folder: Path | None = None) -> CostModel:
    """The measured preset ``name`` for ``num_gpus`` GPUs (``gpus_per_node`` each) whose model states are
    sharded ``sharding``: measured compute, capacity and assumed bandwidths recomputed for this setting."""
    context = integer(context, "context (tokens, e.g. 393216; the CLI also reads 384K)", CostModelError)
    num_gpus = integer(num_gpus, "num_gpus", CostModelError)
    gpus_per_node = integer(gpus_per_node, "gpus_per_node", CostModelError)
    check_sharding(sharding)
    document = load_preset(name, folder)
    profile = document["profile"]
    meta, memory = profile["meta"], profile["meta"]["memory"]
    capacity = token_capacity(memory["memory_bytes"], model_state_bytes(meta["params"], num_gpus, sharding),
                              memory["bytes_per_token"], usable_fraction=memory["usable_fraction"],
                              what=f"measured preset {name} on {num_gpus} GPUs with sharding {sharding!r}:")
    base = CostModel.from_dict(profile)
    bandwidth, assumed = _bandwidths(base, meta, num_gpus, gpus_per_node)
    lengths = [int(n) for n in meta.get("lengths") or ()]
    new_meta = dict(meta, preset=name, context=context, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
                    sharding=sharding, activation_bytes_per_token=memory["bytes_per_token"],
                    memory=dict(memory, num_gpus=num_gpus, sharding=sharding, token_capacity=capacity,
                                model_state_bytes=model_state_bytes(meta["params"], num_gpus, sharding)),
                    provenance=dict(document["provenance"], summary=summary(document)),
                    parts=parts(document), description=document.get("description", ""))
    if assumed is not None:
        new_meta["assumed"] = assumed
    if lengths and context > max(lengths):
        new_meta["context_note"] = (f"compute measured on sequences of {min(lengths):,}-{max(lengths):,} tokens; "
                                    f"longer ones (up to the context, {context:,}) extrapolate the fit")
    data = dict(base.to_dict(), token_capacity=capacity, alltoall_bandwidth={str(d): b for d, b in bandwidth.items()},
                meta=new_meta)
    if "layer_kinds" not in meta["model"]:   # a dense model: the heads it copies at this cluster's Ulysses degrees
        spec = ModelSpec(**{k: meta["model"][k] for k in SHAPE_FIELDS}, name=str(meta["model"].get("name", "custom")))
        data["alltoall_replication"] = {str(u): f for u, f in alltoall_replication(spec, bandwidth).items()}
    return CostModel.from_dict(data)


def _bandwidths(base: CostModel, meta: Mapping[str, Any], num_gpus: int,
                gpus_per_node: int) -> tuple[dict[int, float], dict[str, Any] | None]:
    """All-to-all table for this cluster: measured degrees as profiled; the assumed ones recomputed from the
    recorded interconnect figures for every degree with a tile (and its Ulysses part), as analytic models do."""
    assumed = meta.get("assumed")
    if not isinstance(assumed, Mapping) or "alltoall_bandwidth" not in assumed.get("parts", ()):
        return dict(base.alltoall_bandwidth), None
    figures = assumed.get("figures") or {}
    intra = number(figures.get("intra_node_bandwidth"), "profile.meta.assumed.figures.intra_node_bandwidth",
                   CostModelError, positive=True)
    inter = number(figures.get("inter_node_bandwidth"), "profile.meta.assumed.figures.inter_node_bandwidth",
                   CostModelError, positive=True)
    measured = {int(d): base.alltoall_bandwidth[int(d)] for d in ((meta.get("comm") or {}).get("fits") or {})
                if int(d) in base.alltoall_bandwidth}
    degrees = [d for d in alltoall_degrees(num_gpus, gpus_per_node, base.heads) if d not in measured]
    table = {**measured, **{d: alltoall_bandwidth(d, gpus_per_node, intra, inter) for d in degrees}}
    return dict(sorted(table.items())), dict(assumed, gpus_per_node=gpus_per_node, degrees=degrees)


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def summary(document: Mapping[str, Any]) -> str:
    """One line of provenance: device, driver, torch, date, command, fit error."""
    meta, provenance = document["profile"]["meta"], document["provenance"]
    compute = meta["compute"]
    lengths = [int(n) for n in meta.get("lengths") or ()]
    span = f" over {min(lengths):,}-{max(lengths):,} tokens" if lengths else ""
    return (f"measured on {meta['device']} (driver {provenance['driver']}, torch {meta['torch']}) on {meta['date'][:10]} "
            f"by `{provenance['command']}`; compute fit error {_pct(compute['mean_abs_rel_error'])} mean / "
            f"{_pct(compute['max_abs_rel_error'])} max{span}")


def parts(document: Mapping[str, Any]) -> dict[str, str]:
    """What each part of the cost model is: measured (on what) or assumed (from which figures)."""
    meta = document["profile"]["meta"]
    memory, assumed = meta["memory"], meta.get("assumed") or {}
    assumed_parts = assumed.get("parts", ())
    figures = assumed.get("figures") or {}
    name = assumed.get("interconnect")
    source = (f"assumed from the documented {name} interconnect figures, "
              f"{figures.get('intra_node_bandwidth', 0) / 1e9:g} GB/s all-to-all inside a node and "
              f"{figures.get('inter_node_bandwidth', 0) / 1e9:g} GB/s per GPU across nodes "
              f"({assumed.get('source', 'no source recorded')}; profiled on {meta.get('world_size', 1)} GPU(s), "
              f"where no all-to-all can be measured)")
    ring_source = (f"assumed from the {name} figures, {figures.get('inter_node_bandwidth', 0) / 1e9:g} GB/s per GPU "
                   f"and {figures.get('latency', 0) * 1e6:g} us per hop")
    fits = sorted(int(d) for d in (meta.get("comm") or {}).get("fits") or {})
    ring = meta.get("ring") or {}
    return {
        "compute": f"measured on {meta['device']} ({meta.get('dtype', '?')}, {meta.get('attention', '?')} attention)"
                   + _kinds_note(meta),
        "memory": (f"{'estimated' if memory.get('estimate') else 'measured'} ({memory.get('method', '?')}), "
                   f"{memory['bytes_per_token'] / 2**20:.2f} MiB of activations per token"),
        "alltoall": (f"measured at degrees {fits}" + ("; other degrees " + source if "alltoall_bandwidth" in assumed_parts
                                                      else "")) if fits else
                    (source if "alltoall_bandwidth" in assumed_parts else "none: degree 1 only"),
        "ring": ("measured" if ring.get("measured") else ring_source if "ring_bandwidth" in assumed_parts
                 else "none: degrees up to the Ulysses limit only"),
    }


def _kinds_note(meta: Mapping[str, Any]) -> str:
    """``, per layer kind: 52 x window 1024 (pairs), 10 x full (square)``, kinds not timed marked."""
    kinds = meta.get("kinds")
    if not kinds:
        return ""
    parts = []
    for kind in kinds:
        name = kind["mixer"] + (f" {kind['size']}" if kind["size"] else "")
        how = "NOT TIMED, estimated" if kind.get("estimated") else kind["work"]
        parts.append(f"{kind['layers']} x {name} ({how})")
    return ", per layer kind: " + ", ".join(parts)


# --- contributing a profile ------------------------------------------------------------------------
def wrap_profile(profile: Mapping[str, Any], name: str, *, driver: str, command: str, description: str = "",
                 **provenance: str) -> dict[str, Any]:
    """A preset document around a ``flexsp profile`` JSON (checked as ``read_preset`` would)."""
    document = {"format": FORMAT, "version": VERSION, "name": name, "description": description,
                "provenance": {"driver": driver, "command": command, **provenance}, "profile": dict(profile)}
    return check_preset(document, name)


def main(argv: list[str] | None = None) -> int:
    """``python -m flexsp.plan.measured_presets PROFILE.json --name NAME --driver V --command "..."``."""
    parser = argparse.ArgumentParser(prog="python -m flexsp.plan.measured_presets",
                                     description="Wrap a flexsp profile JSON as a measured preset (docs/simulation.md).")
    parser.add_argument("profile", type=Path, help="the JSON flexsp profile wrote")
    parser.add_argument("--name", required=True, help="preset name, e.g. h100-llama3-8b (GPU and model)")
    parser.add_argument("--driver", required=True, help="GPU driver version (nvidia-smi)")
    parser.add_argument("--command", required=True, help="the flexsp profile command line that wrote the profile")
    parser.add_argument("--description", default="", help="one sentence: hardware, model, anything unusual")
    parser.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                        help="further provenance, e.g. cuda=12.8 or cluster='8 x H100 SXM, NDR IB'")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"where to write (default: {FOLDER}/NAME.json)")
    args = parser.parse_args(argv)
    try:
        extra = dict(note.split("=", 1) for note in args.note if "=" in note)
        profile = load_json(args.profile, "flexsp profile", CostModelError, lambda data: data)
        document = wrap_profile(profile, args.name, driver=args.driver, command=args.command,
                                description=args.description, **extra)
        out = args.output or FOLDER / f"{args.name}.json"
        if out.stem != args.name:
            raise CostModelError(f"the file name must be the preset name: {args.name}.json, got {out.name}")
        write_text(out, json.dumps(document, indent=1), "measured preset", CostModelError)
    except CostModelError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}\n{summary(document)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
