"""``flexsp simulate``, ``plan``, ``profile``, ``replay`` and ``report``: the command line over the planner."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from flexsp.errors import FlexSPError, PlanError
from flexsp.inputs import LIMITS, limit, over_cap, parse_tokens, set_limit, writable_file
from flexsp.plan.analytic import cost_from_hardware
from flexsp.plan.cluster import Cluster
from flexsp.plan.communicator_memory import COMMUNICATOR_BYTES, describe_reservation, pool_degrees, reserve_communicators
from flexsp.plan.config import PlanConfig
from flexsp.plan.cost import CostModel, describe_sources
from flexsp.plan.lengths import OVER_CONTEXT, bound_context, get_distribution, load_lengths, locate
from flexsp.plan.memory import SHARDINGS
from flexsp.plan.measured_presets import measured_names
from flexsp.plan.presets import ANALYTIC_PRESETS, cost_from_preset
from flexsp.profile import cli as profile_cli
from flexsp.replay import cli as replay_cli
from flexsp.profile import selftest as selftest_cli
from flexsp.telemetry import report as report_cli


def whole_number(minimum: int):
    """argparse type: an integer >= ``minimum`` (``--steps -1`` is one error line, never 0 steps run)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, e.g. 2, got {text!r}")
    return value


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB per communicator, e.g. 512, got {text!r}") from None
    if not (value >= 0 and value < 2**40):
        raise argparse.ArgumentTypeError(f"MiB per communicator must be >= 0 and finite, got {text!r}")
    return value


def _degree_set(text: str) -> tuple[int, ...] | str:
    """--degrees: "any" or a comma list of SP degrees (which have tiles is checked with the cluster)."""
    if text.strip().lower() == "any":
        return "any"
    try:
        out = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected any or SP degrees >= 1 like 1,2,3,6,12, got {text!r}")
    return out


def _cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default="gpt-7b", help="preset: the paper's gpt-7b, gpt-13b, gpt-30b, a measured one "
                       f"({', '.join(measured_names())}; docs/simulation.md) or an analytic one with layer kinds and "
                       f"experts ({', '.join(ANALYTIC_PRESETS)}; H100 datasheet figures) (default gpt-7b)")
    group.add_argument("--cost", type=Path, help="cost model JSON (from CostModel.save or flexsp profile)")
    group.add_argument("--analytic", metavar="MODEL:GPU",
                       help="analytic cost model, e.g. llama-7b:h100-80gb (models: llama-7b, llama-13b, llama3-8b, "
                            "llama3-70b, gpt-oss-20b, gemma-3-27b, qwen3.5-27b; GPUs: a100-40gb, a100-80gb, "
                            "h100-80gb); degrees above the head count are "
                            "Ulysses x ring hybrids")
    parser.add_argument("--gpus", type=whole_number(1), default=64, help="number of GPUs (default 64)")
    parser.add_argument("--gpus-per-node", type=whole_number(1), default=8)
    parser.add_argument("--context", type=parse_tokens, default=384 * 1024, help="context limit (default 384K)")
    parser.add_argument("--degrees", type=_degree_set, default=PlanConfig.degrees, metavar="any|D,D,...",
                        help="SP degrees groups may have: any (every size with a tile, inside a node or whole "
                             "nodes, that the cost model can cost) or a list like 1,2,3,6,12 (default: powers of two)")
    parser.add_argument("--time-limit", type=_seconds, default=PlanConfig.time_limit,
                        help=f"solver seconds per batch (default {PlanConfig.time_limit:g})")
    parser.add_argument("--sharding", default=PlanConfig.sharding, choices=SHARDINGS,
                        help=f"model-state sharding the capacity assumes (default {PlanConfig.sharding})")
    parser.add_argument("--communicator-memory", type=_megabytes, nargs="?", const=COMMUNICATOR_BYTES / 2**20,
                        default=None, metavar="MIB",
                        help="subtract the memory of the SP communicators each rank holds (one per degree > 1 in "
                             f"the pool) from the token capacity; MiB each (default {COMMUNICATOR_BYTES // 2**20}, "
                             "see flexsp/plan/communicator_memory.py)")


def _plan_config(args, **strategy: object) -> PlanConfig:
    """The one place the command line's planning settings become a ``PlanConfig``."""
    return PlanConfig(time_limit=args.time_limit, sharding=args.sharding, degrees=args.degrees, **strategy)


def _cost(args) -> CostModel:
    config = _plan_config(args)
    if args.cost is not None:
        return CostModel.load(args.cost)
    if args.analytic is not None:
        model, _, gpu = args.analytic.partition(":")
        return cost_from_hardware(model, gpu or "h100-80gb", num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                                  sharding=config.sharding, recompute=config.recompute)
    return cost_from_preset(args.model, context=args.context, num_gpus=args.gpus, sharding=config.sharding,
                            gpus_per_node=args.gpus_per_node)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as the one ``flexsp <command>: error: ...`` line (status 2)
    that every other input error gets, not the usage block first (``--help`` still shows it). Subcommand
    parsers are built with the parent's class, so they all do this."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="flexsp", description="Plan heterogeneous sequence parallelism.")
    parser.add_argument("--max-input", action="append", default=[], metavar="NAME=VALUE",
                        help="raise a cap on what an input may make FlexSP allocate: " + ", ".join(
                            f"{name} ({text}, default {default}, or ${var})"
                            for name, (var, default, text) in LIMITS.items()))
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="simulate many steps and compare strategies")
    sim.add_argument("--dataset", default="wikipedia",
                     help="wikipedia (bundled), github or commoncrawl (approximations), or a lengths file")
    _cost_args(sim)
    sim.add_argument("--batch-size", type=whole_number(1), default=512, help="sequences per global batch (default 512)")
    sim.add_argument("--steps", type=whole_number(1), default=10, help="simulated steps (default 10)")
    sim.add_argument("--strategies", default=None,
                     help="comma list, e.g. flexsp,batchada,static:64,flexsp[1,8,64] (a [...] suffix restricts "
                          "the SP degrees; default: all strategies, static at N and N/2). Strategies: "
                          + _strategy_help())
    sim.add_argument("--seed", type=whole_number(0), default=0)
    sim.add_argument("--json", type=Path, help="write the full results as JSON")
    sim.add_argument("--plot", type=Path, help="write step times per strategy as PNG")
    sim.add_argument("--gantt", type=Path, help="write the first step's FlexSP plan as a Gantt chart PNG")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.add_argument("--no-progress", dest="quiet", action="store_true", help=argparse.SUPPRESS)   # the scripts' old spelling
    sim.add_argument("--workers", type=whole_number(1), default=1,
                     help="plan this many steps at once in separate processes (same results; default 1)")
    replay_cli.add_simulate_options(sim)

    plan = sub.add_parser("plan", help="plan one batch from a lengths file and write the plan JSON")
    plan.add_argument("lengths", type=Path, help="lengths file (.txt, .txt.gz or .npy)")
    _cost_args(plan)
    plan.add_argument("--strategy", default="flexsp",
                      help="as in simulate --strategies: NAME, static:D (pins the degree) or NAME[1,8,64] (restricts "
                           "the degrees); names: " + _strategy_help())
    plan.add_argument("--sp-degree", type=whole_number(1), help="the SP degree, for a strategy that takes one (static)")
    plan.add_argument("--over-context", choices=OVER_CONTEXT, default="error",
                      help="a sequence longer than --context: refuse the batch (error, the default) or cut it to "
                           "--context tokens (truncate)")
    plan.add_argument("-o", "--output", type=Path, default=Path("plan.json"))
    profile_cli.add_parser(sub)
    replay_cli.add_parser(sub)
    report_cli.add_parser(sub)
    selftest_cli.add_parser(sub)
    return parser


def _strategy_help() -> str:
    from flexsp.plan.strategies import strategies
    return "; ".join(f"{s.name} ({s.description})" for s in strategies()).replace("%", "%%")


def _strategies(args, cluster: Cluster) -> list[str]:
    """--strategies, each entry checked as ``plan --strategy`` checks it (name, degree, [degrees], their tiles
    on the cluster) before any solving: ``static:0`` is an error, not a row of the table."""
    from flexsp.evaluation.simulate import default_strategies
    from flexsp.plan.strategies import names, parse_strategy_list
    if args.strategies is None:
        return default_strategies(cluster)
    listed = parse_strategy_list(args.strategies)
    if not listed:
        raise FlexSPError(f"--strategies {args.strategies!r} names no strategy; e.g. flexsp,batchada,static:64 "
                          f"(strategies: {', '.join(names())})")
    for name in listed:
        try:
            config = PlanConfig(strategy=name)        # name, degree and [degrees], as plan --strategy
            if config.sp_degree is not None:
                cluster.check_degrees([config.sp_degree])
            if config.degrees is not None:
                cluster.check_degrees(config.degrees)
        except PlanError as exc:
            where = "" if repr(name) in str(exc) else f"in {name!r}; "
            raise FlexSPError(f"--strategies: {exc} ({where}static:D pins a degree, a [1,8,64] suffix "
                              f"restricts degrees)") from None
    return listed


def _outputs(*pairs: tuple[Path | None, str]) -> None:
    from flexsp.evaluation.plots import figure_path
    for path, what in pairs:
        if path is not None:
            if what in ("--plot", "--gantt"):
                figure_path(path, what)
            writable_file(path, what, FlexSPError)


def run_simulate(args) -> int:
    from flexsp.evaluation.simulate import describe, format_communicator_memory, format_table, simulate
    _outputs((args.json, "--json"), (args.plot, "--plot"), (args.gantt, "--gantt"))
    cluster = Cluster(args.gpus, args.gpus_per_node)
    strategies = _strategies(args, cluster)
    cost = replay_cli.apply_bandwidth(_cost(args), args)
    distribution = get_distribution(args.dataset)
    sim = simulate(distribution, cost, cluster, strategies, steps=args.steps, batch_size=args.batch_size,
                   context=args.context, seed=args.seed, config=_plan_config(args), progress=not args.quiet,
                   communicator_bytes=_communicator_bytes(args), workers=args.workers, keep_plans=args.replay)
    replayed = replay_cli.replay_simulation(sim, cost, args, progress=not args.quiet) if args.replay else None
    print(describe(sim))
    print(f"cost model: {cost.meta.get('preset') or cost.meta.get('source') or 'custom'}, "
          f"token capacity {cost.token_capacity:.0f} per GPU")
    print(describe_sources(cost))
    label = replayed.pop("_label") if replayed else None
    if replayed:
        print(f"replayed: {label}")
    print(format_table(sim, replayed=replayed))
    if args.communicator_memory is not None:
        print(format_communicator_memory(sim))
    if args.json:
        data = sim.to_dict() if not replayed else dict(sim.to_dict(), replayed={"label": label, "totals": replayed})
        _write(args.json, json.dumps(data, indent=1) + "\n")
    if args.plot or args.gantt:
        from flexsp.evaluation.plots import plot_gantt, plot_step_times
        if args.plot:
            print(f"wrote {plot_step_times(sim, args.plot)}")
        reference = sim.runs.get("flexsp")
        if args.gantt and (reference is None or reference.error or reference.first_plan is None):
            print(f"no Gantt chart written to {args.gantt}: "
                  + ("flexsp is not among --strategies" if reference is None else "flexsp found no plan"))
        elif args.gantt:
            print(f"wrote {plot_gantt(reference.first_plan, sim.first_batch, cost, args.gantt, step=1)}")
    return 0


def run_plan(args) -> int:
    from flexsp.plan.planner import check_held, largest_held, plan_batch
    _outputs((args.output, "-o/--output"))
    cluster = Cluster(args.gpus, args.gpus_per_node)
    where = lambda i: locate(args.lengths, i)          # noqa: E731 (errors name the file's line, not an index)
    lengths, cut = bound_context(load_lengths(args.lengths), args.context, args.over_context, where=where)
    if cut:
        print(f"cut {cut} sequence(s) to the context limit {args.context:,} tokens (--over-context truncate)")
    cost = _cost(args)
    config = _plan_config(args, strategy=args.strategy, sp_degree=args.sp_degree)
    if args.communicator_memory is not None:
        pool = pool_degrees(cluster, "flexsp", config.degrees, None, cost)     # every degree plans may use
        cost = reserve_communicators(cost, pool, _communicator_bytes(args), gpus_per_node=cluster.gpus_per_node)
        print(describe_reservation(cost))
    check_held(lengths, cost, cluster, largest_held(cost, cluster, config)[1],
               where=lambda i: f"{where(i)}: a sequence of {lengths[i]:,} tokens")
    plan = plan_batch(lengths, cost, cluster, config=config)
    print(f"{args.strategy}: {len(lengths)} sequences -> {len(plan.micro_batches)} micro-batches, "
          f"groups {plan.degree_histogram()}, predicted {plan.predicted_time:.3f} s, solved in {plan.solve_time:.2f} s")
    _write(args.output, plan.to_json() + "\n")
    return 0


def _bounded(args) -> None:
    """Counts that size an allocation, checked against their caps before anything is allocated."""
    cap = limit("sequences")
    if getattr(args, "batch_size", None) is not None and args.batch_size > cap:
        raise FlexSPError(over_cap("--batch-size", args.batch_size, "sequences", "sequences"))
    for flag in ("gpus", "gpus_per_node"):
        if getattr(args, flag, None) is not None and getattr(args, flag) > limit("gpus"):
            raise FlexSPError(over_cap(f"--{flag.replace('_', '-')}", getattr(args, flag), "gpus", "GPUs"))
    if getattr(args, "workers", None) is not None and args.workers > 4 * (os.cpu_count() or 1):
        raise FlexSPError(f"--workers {args.workers}: more than 4x this machine's {os.cpu_count()} CPUs")


def _communicator_bytes(args) -> float | None:
    return None if args.communicator_memory is None else args.communicator_memory * 2**20


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise FlexSPError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:         # named by the command they were given to, like every other argument error
        parser.exit(2, f"flexsp {args.command}: error: unrecognized arguments: {' '.join(unknown)} "
                       f"(usage: flexsp {args.command} --help)\n")
    try:
        for assignment in args.max_input:
            set_limit(assignment)
        _bounded(args)
        return {"simulate": run_simulate, "plan": run_plan, "profile": profile_cli.run,
                "replay": replay_cli.run, "report": report_cli.run, "selftest": selftest_cli.run}[args.command](args)
    except FlexSPError as exc:
        print(f"flexsp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"flexsp {args.command}: error: this command needs {exc.name.partition('.')[0]}, which is not "
              f"installed: pip install 'flexsp[{extra}]' (a planner-only install has no runtime)", file=sys.stderr)
        return 2


# the optional dependency a command may need -> the pyproject extra that installs it
_EXTRAS = {"torch": "train", "flash_attn": "gpu", "transformers": "hf", "datasets": "hf"}


if __name__ == "__main__":
    sys.exit(main())
