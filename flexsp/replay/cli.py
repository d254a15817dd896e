"""``flexsp replay`` and the ``--replay`` options of ``flexsp simulate``.

``add_parser(subparsers)`` registers ``replay``; ``add_simulate_options(parser)`` adds ``--replay`` and
its settings to ``simulate``; ``replay_simulation(sim, cost, args)`` replays every plan a simulation
kept. torch is imported only when a replay runs, so registering costs a planner-only install nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from flexsp.errors import CostModelError, FlexSPError
from flexsp.plan.presets import cost_from_preset

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab")


def _device_options(parser: argparse.ArgumentParser, model_flag: str) -> None:
    m = parser.add_argument_group("replayed model (the runtime's TinyLM at these shapes)")
    m.add_argument(f"--{model_flag}", dest="replay_model", default=None,
                   help="shape preset: tiny, small, llama-7b, llama-13b, llama3-8b, llama3-70b (default: the shape "
                        "the cost model records, e.g. a flexsp profile); the flags below override fields")
    for name in SHAPE_FLAGS:
        m.add_argument(f"--{name}", type=int, default=None)
    m.add_argument("--hf-config", type=Path, default=None,
                   help="replay a Hugging Face causal LM from this config directory (random weights) instead")
    m.add_argument("--run-layers", type=int, default=None,
                   help="run this many blocks and scale up to --layers (for models that do not fit one device)")
    d = parser.add_argument_group("replay device and timing")
    d.add_argument("--bandwidth", type=Path, default=None,
                   help="measured all-to-all table replacing the cost model's bandwidths: a cost model JSON (e.g. "
                        "flexsp profile under torchrun) or {\"2\": bytes_per_s, ...}")
    d.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    d.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    d.add_argument("--attention", default="auto", help="attention backend: auto (the kernel rule of flexsp.runtime.kernels.rule on CUDA, sdpa_each on CPU), "
                   "varlen, varlen_cudnn, flash, sdpa, sdpa_each")
    d.add_argument("--threads", type=int, default=None, help="CPU threads for torch (1 is steadier on a shared box)")
    d.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="wall (default), or cpu: this process's CPU time (CPU runs with --threads 1 on a shared box)")
    d.add_argument("--repeats", type=int, default=3, help="timed runs per group (default 3)")
    d.add_argument("--warmup", type=int, default=1, help="untimed runs per group first (default 1)")
    d.add_argument("--statistic", default="median", choices=("median", "min", "mean"))
    d.add_argument("--replay-seed", type=int, default=0, help="seed of the random weights and token ids")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay", help="run every group of a plan on this device: measured compute, modelled communication",
        description="For every group of every micro-batch, run one representative rank's forward and backward "
                    "on this device (the all-to-all replaced by a local stand-in), add the all-to-all time from "
                    "the cost model's bandwidths (or --bandwidth), and compare the makespans with the prediction.")
    p.add_argument("plan", type=Path, help="plan JSON (flexsp plan -o, Plan.save)")
    p.add_argument("--lengths", type=Path, required=True, help="the lengths file the plan was made for")
    c = p.add_mutually_exclusive_group(required=True)
    c.add_argument("--cost", type=Path, help="cost model JSON (flexsp profile, CostModel.save)")
    c.add_argument("--preset", help="preset cost model: the paper's gpt-7b, gpt-13b, gpt-30b or a measured one "
                                    "(e.g. h200-llama3-8b), with --context")
    p.add_argument("--context", default="384K", help="context of --preset (default 384K)")
    _device_options(p, "model")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, help="write the full report as JSON")
    o.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown")
    o.add_argument("--gantt", type=Path, default=None,
                   help="write a Gantt chart, predicted above replayed (.png, .pdf or .svg)")
    o.add_argument("--quiet", action="store_true", help="no per-group progress lines")
    p.set_defaults(func=run)
    return p


def add_simulate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replay", action="store_true",
                        help="also replay every simulated plan on this device (measured compute + modelled "
                             "communication) and add those columns to the table")
    _device_options(parser, "replay-model")


# --------------------------------------------------------------------------------------------------
def apply_bandwidth(cost, args: argparse.Namespace):
    """``cost`` with ``--bandwidth``'s measured table in place of its all-to-all bandwidths (if given):
    plans, predictions and the replay's modelled communication then all use it."""
    from flexsp.replay.comm_time import load_bandwidth_table, with_bandwidth
    if getattr(args, "bandwidth", None) is None:
        return cost
    return with_bandwidth(cost, load_bandwidth_table(args.bandwidth), f"measured table {args.bandwidth}")


def build(cost, args: argparse.Namespace):
    """The ``Replayer`` the arguments describe (and ``cost``, unchanged: see ``apply_bandwidth``)."""
    import torch

    from flexsp.profile.compute import DeviceSetup
    from flexsp.profile.shape import model_spec
    from flexsp.replay.replay import Replayer
    from flexsp.replay.runner import ReplayModel

    if args.threads is not None:
        if args.threads < 1:
            raise CostModelError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        setup = DeviceSetup.resolve(args.device, args.dtype, args.attention)
    except (ValueError, RuntimeError) as exc:
        raise CostModelError(f"device: {exc}") from None
    options = dict(repeats=args.repeats, warmup=args.warmup, statistic=args.statistic, clock=args.clock,
                   seed=args.replay_seed)
    if args.hf_config is not None:
        from flexsp.replay.hf import hf_replay_model
        return Replayer(hf_replay_model(args.hf_config, setup, args.run_layers, args.replay_seed), setup, **options), cost
    overrides = {f.replace("-", "_"): getattr(args, f.replace("-", "_")) for f in SHAPE_FLAGS}
    if args.replay_model is None:
        recorded = cost.meta.get("model") if isinstance(cost.meta, dict) else None
        if not isinstance(recorded, dict):
            raise CostModelError("the cost model records no model shape: name the model to replay (--model / "
                                 "--replay-model tiny|small|llama-7b|...)")
        spec = model_spec(None, **{k: recorded.get(k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")})
        spec = model_spec(None, **{k: overrides[k] if overrides[k] is not None else getattr(spec, k) for k in overrides})
        spec = dataclasses.replace(spec, name=str(recorded.get("name", "custom")))
    else:
        spec = model_spec(args.replay_model, **overrides)
    return Replayer(ReplayModel.from_spec(spec, setup, args.run_layers, seed=args.replay_seed), setup, **options), cost


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except FlexSPError as exc:
        print(f"flexsp replay: error: {exc}", file=sys.stderr)
        return 2


def _check_outputs(args: argparse.Namespace) -> None:
    """``--json``, ``--markdown`` and ``--gantt`` writable, ``--gantt`` a picture (``.png``, ``.pdf`` or ``.svg``, as
    every FlexSP plot), checked before the replay, whose minutes an unwritable output would otherwise waste at the end."""
    from flexsp.inputs import writable_file
    if args.gantt is not None:
        from flexsp.evaluation.plots import figure_path
        figure_path(args.gantt, "--gantt")
    for path, what in ((args.json, "--json"), (args.markdown, "--markdown"), (args.gantt, "--gantt")):
        if path is not None:
            writable_file(path, what, FlexSPError)


def _run(args: argparse.Namespace) -> int:
    from flexsp.inputs import parse_tokens
    from flexsp.plan.cost import CostModel
    from flexsp.plan.lengths import load_lengths
    from flexsp.plan.types import Plan
    from flexsp.replay.report import format_groups, summary

    _check_outputs(args)
    plan = Plan.load(args.plan)
    lengths = load_lengths(args.lengths).tolist()
    if args.cost is not None:
        cost = CostModel.load(args.cost)
    else:
        try:
            context = parse_tokens(args.context)
        except argparse.ArgumentTypeError as exc:
            raise CostModelError(str(exc)) from None
        cost = cost_from_preset(args.preset, context=context, num_gpus=plan.num_gpus)
    replayer, cost = build(apply_bandwidth(cost, args), args)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    report = replayer.replay(plan, lengths, cost, progress=say)
    for note in report.meta.get("notes", []):
        print(f"note: {note}")
    print(format_groups(report))
    print(summary(report))
    if args.json:
        print(f"wrote {report.save(args.json)}")
    if args.markdown:
        args.markdown.write_text(f"# Replay of {args.plan}\n\n{report.meta['label']}\n\n{format_groups(report)}\n\n"
                                 f"{summary(report)}\n")
        print(f"wrote {args.markdown}")
    if args.gantt:
        from flexsp.replay.plot import plot_replay_gantt
        print(f"wrote {plot_replay_gantt(report, args.gantt)}")
    return 0


def replay_simulation(sim, cost, args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """Replay every plan ``sim`` kept (``simulate(..., keep_plans=True)``): strategy -> replayed total
    seconds (measured compute + modelled communication), plus ``"_label"`` describing the measurement.
    A strategy whose plans cannot run for this model (e.g. a degree above its head count) is left out
    and said so on stderr; the others are still replayed."""
    from tqdm.auto import tqdm

    replayer, cost = build(cost, args)
    totals: dict[str, Any] = {}
    todo = sum(len(run.plans) for run in sim.runs.values() if not run.error)
    bar = tqdm(total=todo, desc="replay", disable=not progress, leave=False)
    label = ""
    for name, run in sim.runs.items():
        if run.error:
            continue
        try:
            total = 0.0
            for plan, lengths in run.plans:
                report = replayer.replay(plan, lengths, cost)
                total += report.replayed_time
                label = report.meta["label"]
                bar.update(1)
            totals[name] = total
        except FlexSPError as exc:
            print(f"replay: {name} not replayed: {exc}", file=sys.stderr)
    bar.close()
    if not totals:
        raise CostModelError("no strategy's plans could be replayed (see the messages above)")
    totals["_label"] = label
    return totals
