"""``flexsp simulate`` and ``flexsp plan``: the command line over the planner."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .cluster import Cluster
from .cost import CostModel
from .errors import FlexSPError
from .lengths import get_distribution, load_lengths
from .profile import cli as profile_cli
from .replay import cli as replay_cli

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str) -> int:
    """``393216``, ``384K`` (x1024) or ``2M`` (x1024^2)."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count like 393216, 384K or 2M, got {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()
    return int(value * {"": 1, "k": 1024, "m": 1024 ** 2}[unit])


def _cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default="gpt-7b", help="paper preset: gpt-7b, gpt-13b, gpt-30b (default gpt-7b)")
    group.add_argument("--cost", type=Path, help="cost model JSON (from CostModel.save or flexsp profile)")
    group.add_argument("--analytic", metavar="MODEL:GPU",
                       help="analytic cost model, e.g. llama-7b:h100-80gb (models: llama-7b, llama-13b, llama3-8b, "
                            "llama3-70b; GPUs: a100-40gb, a100-80gb, h100-80gb); degrees above the head count are "
                            "Ulysses x ring hybrids")
    parser.add_argument("--gpus", type=int, default=64, help="number of GPUs (default 64)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--context", type=parse_tokens, default=384 * 1024, help="context limit (default 384K)")
    parser.add_argument("--time-limit", type=float, default=2.0, help="solver seconds per batch (default 2)")


def _cost(args) -> CostModel:
    if args.cost is not None:
        return CostModel.load(args.cost)
    if args.analytic is not None:
        model, _, gpu = args.analytic.partition(":")
        return CostModel.from_hardware(model, gpu or "h100-80gb", num_gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    return CostModel.from_preset(args.model, context=args.context, num_gpus=args.gpus)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexsp", description="Plan heterogeneous sequence parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="simulate many steps and compare strategies")
    sim.add_argument("--dataset", default="wikipedia",
                     help="wikipedia (bundled), github or commoncrawl (approximations), or a lengths file")
    _cost_args(sim)
    sim.add_argument("--batch-size", type=int, default=512, help="sequences per global batch (default 512)")
    sim.add_argument("--steps", type=int, default=10, help="simulated steps (default 10)")
    sim.add_argument("--strategies", default=None,
                     help="comma list, e.g. flexsp,batchada,static:64,flexsp[1,8,64] (a [...] suffix restricts "
                          "the SP degrees; default: all strategies, static at N and N/2)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", type=Path, help="write the full results as JSON")
    sim.add_argument("--plot", type=Path, help="write step times per strategy as PNG")
    sim.add_argument("--gantt", type=Path, help="write the first step's FlexSP plan as a Gantt chart PNG")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    replay_cli.add_simulate_options(sim)

    plan = sub.add_parser("plan", help="plan one batch from a lengths file and write the plan JSON")
    plan.add_argument("lengths", type=Path, help="lengths file (.txt, .txt.gz or .npy)")
    _cost_args(plan)
    plan.add_argument("--strategy", default="flexsp")
    plan.add_argument("--sp-degree", type=int, help="degree for --strategy static")
    plan.add_argument("-o", "--output", type=Path, default=Path("plan.json"))
    profile_cli.add_parser(sub)
    replay_cli.add_parser(sub)
    return parser


def run_simulate(args) -> int:
    from .simulate import default_strategies, describe, format_table, parse_strategy_list, simulate
    cluster = Cluster(args.gpus, args.gpus_per_node)
    cost = replay_cli.apply_bandwidth(_cost(args), args)
    distribution = get_distribution(args.dataset)
    strategies = parse_strategy_list(args.strategies) if args.strategies else default_strategies(cluster)
    sim = simulate(distribution, cost, cluster, strategies, steps=args.steps, batch_size=args.batch_size,
                   context=args.context, seed=args.seed, time_limit=args.time_limit, progress=not args.quiet,
                   keep_plans=args.replay)
    replayed = replay_cli.replay_simulation(sim, cost, args, progress=not args.quiet) if args.replay else None
    print(describe(sim))
    print(f"cost model: {cost.meta.get('preset') or cost.meta.get('source') or 'custom'}, "
          f"token capacity {cost.token_capacity:.0f} per GPU")
    label = replayed.pop("_label") if replayed else None
    if replayed:
        print(f"replayed: {label}")
    print(format_table(sim, replayed=replayed))
    if args.json:
        data = sim.to_dict() if not replayed else dict(sim.to_dict(), replayed={"label": label, "totals": replayed})
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot or args.gantt:
        from .plots import plot_gantt, plot_step_times
        if args.plot:
            print(f"wrote {plot_step_times(sim, args.plot)}")
        reference = sim.runs.get("flexsp")
        if args.gantt and reference is not None and reference.first_plan is not None:
            print(f"wrote {plot_gantt(reference.first_plan, sim.first_batch, cost, args.gantt)}")
    return 0


def run_plan(args) -> int:
    from .planner import plan_batch
    cluster = Cluster(args.gpus, args.gpus_per_node)
    lengths = load_lengths(args.lengths)
    plan = plan_batch(lengths, _cost(args), cluster, args.strategy, sp_degree=args.sp_degree, time_limit=args.time_limit)
    plan.save(args.output)
    print(f"{args.strategy}: {len(lengths)} sequences -> {len(plan.micro_batches)} micro-batches, "
          f"groups {plan.degree_histogram()}, predicted {plan.predicted_time:.3f} s, solved in {plan.solve_time:.2f} s")
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"simulate": run_simulate, "plan": run_plan, "profile": profile_cli.run,
                "replay": replay_cli.run}[args.command](args)
    except FlexSPError as exc:
        print(f"flexsp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
