"""Planner benchmark (issues 2, 27): solve time and plan quality in the paper's setting, and scaling.

Paper setting: bundled Wikipedia lengths, gpt-7b preset, 64 GPUs, 384K context, global batch 512.
Prints (and writes as Markdown) the median / max solve time, each strategy's simulated iteration
time, the plan / lower-bound ratio, and the speedup over static SP 64; then solve time against the
GPU count (16..1024, batch 8 x N, at most 4096) and the batch size (128..4096); then (full mode)
how far each strategy runs past a 0.5 s ``time_limit`` on issue 21's batches that need thousands
of micro-batches; then (issue 43) the pace on small batches: 8-64 sequences on 4-16 GPUs with the HF
Trainer's default cost (a per-rank token budget, ``flexsp.plan.token_budget``) and analytic presets,
each row met or MISSED against a 20 ms median with no batch at the 1 s deadline (the Trainer's
``flexsp_time_limit``). Solve times are medians of the repeats, both wall clock (``Plan.solve_time``) and
the process's CPU time over the same span (what the planner itself costs, about the same on a
loaded machine; validation is run outside both); a full
run appends both medians to ``experiments/results/solve_time_history.md``.

    python experiments/planner_benchmark.py            # full: 20 batches + scaling
    python experiments/planner_benchmark.py --quick    # CI: 2 small batches, tiny scaling, 2 pace rows
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.plan.bounds import coupled_lower_bound, gap_breakdown, lower_bound
from flexsp.plan.analytic import analytic_cost_model
from flexsp.plan.lengths import get_distribution, preprocess
from flexsp.plan.token_budget import token_budget_cost
from outputs import resolve_out  # noqa: E402

STRATEGY_NAMES = ("flexsp", "greedy", "batchada", "static", "dynamic-cp")
STRATEGIES = {"flexsp": ("flexsp", None), "greedy": ("greedy", None), "batchada": ("batchada", None),
              "static64": ("static", 64)}


def batches(num: int, size: int, num_gpus: int, context: int, seed: int):
    dist = get_distribution("wikipedia")
    pool = dist.lengths[dist.lengths <= context]
    rng = np.random.default_rng(seed)
    for _ in range(num):
        yield preprocess(pool[rng.integers(0, pool.size, size=size)], context, num_gpus)[0]


# issue 27: median solve <= 0.2 s, plan / coupled bound <= 1.05 (the aim 1.03); the simple bound's 1.08
# of issue 2 is still printed
TARGET_MEDIAN_SOLVE, TARGET_MAX_SOLVE, TARGET_COUPLED, TARGET_RATIO, TARGET_SPEEDUP = 0.2, 3.0, 1.05, 1.08, 1.6
AIM_COUPLED = 1.03
# issue 43: FlexSP's plan time in the paper setting at most this fraction of batchada's (the best
# single-degree plan, the reference the paper's speedups are measured against)
TARGET_VS_BATCHADA = 0.93
# issue 43: small batches solve in <= 20 ms median, none reaching the Trainer's 1 s deadline
TARGET_PACE, PACE_TIME_LIMIT = 0.020, 1.0
PACE_COSTS = {
    "HF Trainer default (4 x 256, 4,096 tokens/rank)": lambda n: token_budget_cost(4, 256, n, 4096),
    "llama3-8b / h100-80gb (analytic)": lambda n: analytic_cost_model("llama3-8b", "h100-80gb", num_gpus=n),
    "llama-7b / a100-80gb (analytic)": lambda n: analytic_cost_model("llama-7b", "a100-80gb", num_gpus=n),
}
HISTORY = Path(__file__).parent / "results" / "solve_time_history.md"
HISTORY_HEADER = ("| date (UTC) | commit | benchmark | setting | solve median wall (s) | solve median CPU (s) | load | "
                  "reference loop (s) |\n|---|---|---|---|---|---|---|---|\n")
# ``reference_loop``'s work: 10 million integer additions in the interpreter, the kind of work the planner's
# search does, inside a function as the planner's loops are. It took 0.52-0.63 s on this project's machine on
# 2026-11-27: solve times here are comparable across days only next to this figure.
REFERENCE_ITERATIONS = 10_000_000


def reference_loop(repeats: int = 3) -> float:
    """Seconds of a fixed pure-Python loop, best of ``repeats``: how fast this machine runs the planner's
    kind of work right now (the shared 2-core machine's speed has varied about 3x between days)."""
    best = math.inf
    for _ in range(repeats):
        started, total = time.perf_counter(), 0
        for i in range(REFERENCE_ITERATIONS):
            total += i
        best = min(best, time.perf_counter() - started)
    return best


def machine_line(started: float, load: float, reference: float) -> str:
    """The footer every solve-time report ends with: elapsed time, load and the reference loop."""
    return (f"(measured on this 2-core machine in {time.time() - started:.0f} s; load average {load:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end; the reference loop (`planner_benchmark.reference_loop`, "
            f"{REFERENCE_ITERATIONS:,} interpreted additions) took {reference:.2f} s: solve times scale with both)")


def append_history(setting: str, benchmark: str, wall: float, cpu: float, load: float, reference: float,
                   path: Path = HISTORY) -> None:
    """One row per full run: how the solve time moved, commit by commit (never written by --quick)."""
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "?"
    if not path.exists():
        path.write_text("Solve-time history of the planner benchmarks (wall and CPU medians, this project's 2-core "
                        "shared machine; the load average says how shared, the reference loop how fast the machine "
                        "ran that day).\n\n" + HISTORY_HEADER)
    with path.open("a") as f:
        f.write(f"| {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} | {commit} | {benchmark} | {setting} | "
                f"{wall:.3f} | {cpu:.3f} | {load:.1f} | {reference:.2f} |\n")
LABEL = ("Plan and iteration times are **simulated** with the paper's gpt-7b cost model (`flexsp.cost_from_preset`, "
         "64 x A100-40GB constants); solve times are **measured** on this project's 2-core shared CPU.")


def speed_note(load: float, reference: float | None) -> str:
    """The README blocks' note on the machine: load, and how fast it ran the reference loop that day."""
    loop = ("" if reference is None else f"; the reference loop (`planner_benchmark.reference_loop`) took "
            f"{reference:.2f} s, and solve times scale with it")
    return f"Load average {load:.1f} at the start of the run{loop}."


def readme_block(summary: dict, load: float, reference: float | None = None) -> str:
    """The README's summary table (``<!-- generated: readme -->``), every target marked met or missed."""
    solve_missed = [name for name, value, target in (("median", summary["median_solve"], TARGET_MEDIAN_SOLVE),
                                                      ("max", summary["max_solve"], TARGET_MAX_SOLVE))
                    if value > target]
    solve = "met" if not solve_missed else f"**{' and '.join(solve_missed)} missed**"
    over = (summary["mean_ratio"] / TARGET_RATIO - 1) * 100
    ratio = "met" if summary["mean_ratio"] <= TARGET_RATIO else f"**missed by {over:.1f}%**"
    over = (summary["mean_coupled"] / TARGET_COUPLED - 1) * 100
    coupled = "met" if summary["mean_coupled"] <= TARGET_COUPLED else f"**missed by {over:.1f}%**"
    aim = (summary["mean_coupled"] / AIM_COUPLED - 1) * 100
    speed = "met" if summary["speedup_static64"] >= TARGET_SPEEDUP else "**missed**"
    return "\n".join([
        f"{LABEL} {speed_note(load, reference)}", "",
        "| | value | target |", "|---|---|---|",
        f"| FlexSP solve time per global batch (measured) | median {summary['median_solve']:.2f} s, "
        f"max {summary['max_solve']:.2f} s; CPU median {summary.get('median_cpu', float('nan')):.2f} s "
        f"| median <= {TARGET_MEDIAN_SOLVE:g} s, max <= {TARGET_MAX_SOLVE:g} s: {solve} |",
        f"| plan time / lower bound (simulated) | mean {summary['mean_ratio']:.3f}, max {summary['max_ratio']:.3f} "
        f"| mean <= {TARGET_RATIO}: {ratio} |",
        f"| plan time / coupled bound (simulated) | mean {summary['mean_coupled']:.3f}, max {summary['max_coupled']:.3f} "
        f"| mean <= {TARGET_COUPLED}: {coupled} (aim {AIM_COUPLED}: {max(aim, 0.0):.1f}% away) |",
        f"| speedup over static SP 64 (simulated) | {summary['speedup_static64']:.2f}x | >= {TARGET_SPEEDUP}x: {speed} |",
        f"| speedup over batchada (simulated) | {summary['speedup_batchada']:.2f}x | |", ""])


def paper_setting(num_batches: int, batch_size: int, time_limit: float) -> tuple[str, dict]:
    context, num_gpus = 384 * 1024, 64
    cost = flexsp.cost_from_preset("gpt-7b", context=context, num_gpus=num_gpus)
    cluster = flexsp.Cluster(num_gpus, 8)
    times = {name: [] for name in STRATEGIES}
    solve, cpu, ratios, coupled, gaps, bounds, simple, lp_only = [], [], [], [], [], [], [], []
    for lengths in tqdm(list(batches(num_batches, batch_size, num_gpus, context, seed=0)), desc="paper setting"):
        bound = lower_bound(lengths, cost, cluster)
        tight = coupled_lower_bound(lengths, cost, cluster)
        lp_alone = coupled_lower_bound(lengths, cost, cluster, memory_split=False)   # the bound before issue 27's split
        for name, (strategy, degree) in STRATEGIES.items():
            cpu_started = time.process_time()
            plan = flexsp.plan_batch(lengths, cost, cluster, strategy, sp_degree=degree, time_limit=time_limit,
                                     validate=False)
            planned_cpu = time.process_time() - cpu_started     # the same span as plan.solve_time
            plan.validate(lengths, cost, cluster)
            times[name].append(plan.predicted_time)
            if name == "flexsp":
                cpu.append(planned_cpu)
                gaps.append(gap_breakdown(plan, lengths, cost, cluster))
                bounds.append(tight)
                simple.append(bound)
                solve.append(plan.solve_time)
                ratios.append(plan.predicted_time / bound)
                coupled.append(plan.predicted_time / tight)
                lp_only.append(plan.predicted_time / lp_alone)
    fx = np.array(times["flexsp"])
    lines = [f"### Paper setting: Wikipedia, gpt-7b, 64 GPUs, 384K, batch {batch_size}, {num_batches} batches",
             "", "| strategy | mean iteration (s) | FlexSP speedup |", "|---|---|---|"]
    for name, values in times.items():
        lines.append(f"| {name} | {np.mean(values):.3f} | {np.mean(np.array(values) / fx):.2f}x |")
    summary = {"median_solve": float(np.median(solve)), "max_solve": float(np.max(solve)),
               "median_cpu": float(np.median(cpu)),
               "mean_ratio": float(np.mean(ratios)), "max_ratio": float(np.max(ratios)),
               "mean_coupled": float(np.mean(coupled)), "max_coupled": float(np.max(coupled)),
               "mean_lp_only": float(np.mean(lp_only)), "max_lp_only": float(np.max(lp_only)),
               "speedup_static64": float(np.mean(np.array(times["static64"]) / fx)),
               "speedup_batchada": float(np.mean(np.array(times["batchada"]) / fx)),
               "vs_batchada": float(np.mean(fx / np.array(times["batchada"])))}
    solve_ok = summary["median_solve"] <= TARGET_MEDIAN_SOLVE and summary["max_solve"] <= TARGET_MAX_SOLVE
    lines += ["", f"- FlexSP solve time (wall): median {summary['median_solve']:.3f} s, max {summary['max_solve']:.3f} s "
                  f"(target median <= {TARGET_MEDIAN_SOLVE:g} s, max <= {TARGET_MAX_SOLVE:g} s: "
                  f"{'met' if solve_ok else 'MISSED'}); CPU median {summary['median_cpu']:.3f} s",
              f"- FlexSP plan / lower bound: mean {summary['mean_ratio']:.4f}, max {summary['max_ratio']:.4f} "
              f"(issue-2 target mean <= {TARGET_RATIO}: {'met' if summary['mean_ratio'] <= TARGET_RATIO else 'MISSED'})",
              f"- FlexSP plan / coupled bound: mean {summary['mean_coupled']:.4f}, max {summary['max_coupled']:.4f} "
              f"(target mean <= {TARGET_COUPLED}: {'met' if summary['mean_coupled'] <= TARGET_COUPLED else 'MISSED'}; "
              f"aim {AIM_COUPLED}, {max(summary['mean_coupled'] / AIM_COUPLED - 1, 0.0):.1%} away; "
              "flexsp.plan.bounds.coupled_lower_bound, the tighter bound, with the memory split of issue 27: memory "
              "caps what the longest sequence's micro-batch can compute; without it, the LP alone: mean "
              f"{summary['mean_lp_only']:.4f}, max {summary['max_lp_only']:.4f})",
              gap_line(gaps, times["flexsp"], bounds, simple),
              f"- speedup over static SP 64: {summary['speedup_static64']:.2f}x (target >= 1.6x); "
              f"over batchada: {summary['speedup_batchada']:.2f}x",
              f"- FlexSP plan time / batchada's: mean {summary['vs_batchada']:.3f} (target <= {TARGET_VS_BATCHADA}: "
              f"{'met' if summary['vs_batchada'] <= TARGET_VS_BATCHADA else 'MISSED'})"]
    return "\n".join(lines), summary


def gap_line(gaps: list[dict], plan_times: list[float], bounds: list[float], simple: list[float]) -> str:
    """What FlexSP's plan time is made of (``flexsp.plan.bounds.gap_breakdown``), as shares of the plan
    time summed over the batches, and what its gap to the coupled bound is made of: degrees above
    the cheapest, idle GPUs and micro-batches beyond the fewest memory allows, less what the coupled
    bound already proves above the simple one (shares of the coupled bound, summed over batches)."""
    total = float(np.sum(plan_times))
    keys = ("area", "degree", "idle", "beta1", "extra_micro_batches")
    parts = {k: sum(g[k] for g in gaps) / total for k in keys}
    tight = float(np.sum(bounds))
    proven = (tight - float(np.sum(simple))) / tight
    gap = {k: sum(g[k] for g in gaps) / tight for k in ("degree", "idle", "extra_micro_batches")}
    worst = np.argsort(np.array(plan_times) / np.array(bounds))[::-1][:3]
    return (f"- what the plan time is made of (share of the plan time): perfect spread of the cheapest compute "
            f"{parts['area']:.1%}, higher degrees than the cheapest {parts['degree']:.1%}, GPUs idle in a "
            f"micro-batch {parts['idle']:.1%}, beta1 of the fewest micro-batches memory allows {parts['beta1']:.1%}, "
            f"beta1 of further micro-batches {parts['extra_micro_batches']:.1%}\n"
            f"- the gap to the coupled bound, summed over the batches ({(total - tight) / tight:.1%} of the bounds' sum) = "
            f"higher degrees {gap['degree']:.1%} + "
            f"idle {gap['idle']:.1%} + further micro-batches {gap['extra_micro_batches']:.1%} - what the coupled bound "
            f"proves above the simple one {proven:.1%}; worst batches (plan / coupled bound): "
            + ", ".join(f"#{i} {plan_times[i] / bounds[i]:.3f}" for i in worst))


def scaling(gpu_counts: list[int], batch_sizes: list[int], reps: int, time_limit: float) -> str:
    context = 384 * 1024
    lines = ["### Solve time vs GPUs (batch 8 x N, at most 4096) and vs batch size (64 GPUs)", "",
             "| GPUs | batch | FlexSP solve median / max (s) | plan / lower bound | plan / coupled bound | greedy solve (s) |",
             "|---|---|---|---|---|---|"]
    cases = [(n, min(8 * n, 4096)) for n in gpu_counts] + [(64, b) for b in batch_sizes]
    for num_gpus, size in tqdm(cases, desc="scaling"):
        cost = flexsp.cost_from_preset("gpt-7b", context=context, num_gpus=num_gpus)
        cluster = flexsp.Cluster(num_gpus, 8)
        solve, ratio, tight, greedy = [], [], [], []
        for lengths in batches(reps, size, num_gpus, context, seed=1):
            plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=time_limit)
            solve.append(plan.solve_time)
            ratio.append(plan.predicted_time / lower_bound(lengths, cost, cluster))
            tight.append(plan.predicted_time / coupled_lower_bound(lengths, cost, cluster))
            greedy.append(flexsp.plan_batch(lengths, cost, cluster, "greedy", time_limit=time_limit).solve_time)
        lines.append(f"| {num_gpus} | {size} | {np.median(solve):.3f} / {np.max(solve):.3f} | {np.mean(ratio):.4f} | "
                     f"{np.mean(tight):.4f} | {np.median(greedy):.3f} |")
    return "\n".join(lines)


def small_batches(gpu_counts: list[int], sizes: list[int], reps: int, costs: dict = PACE_COSTS) -> tuple[str, bool]:
    """Issue 43's pace rows: FlexSP's wall solve time on batches of ``sizes`` Wikipedia sequences (those a
    cluster's largest group holds) on ``gpu_counts`` GPUs under each cost model, median and max of
    ``reps`` batches, how many reached the 1 s time limit, and the plan / simple lower bound; each row met
    or MISSED (median <= 20 ms and none at the limit). Returns the table and whether every row met it."""
    wiki = get_distribution("wikipedia").lengths
    lines = [f"### Small batches: solve pace (time_limit {PACE_TIME_LIMIT:g} s, the Trainer's default; {reps} batches a row)", "",
             "Solve times **measured** (wall, this machine); plan / lower bound **simulated** with each row's cost "
             "model (`flexsp.plan.token_budget`, `flexsp.plan.analytic`); batches of 8 or fewer sequences are solved "
             "exactly (`solver/exact.py`).", "",
             "| cost model | GPUs | batch | solve median / max (ms) | at the time limit | plan / lower bound | "
             f"target (median <= {TARGET_PACE * 1e3:.0f} ms, none at the limit) |", "|---|---|---|---|---|---|---|"]
    all_met = True
    for name, build in costs.items():
        for num_gpus in gpu_counts:
            cost, cluster = build(num_gpus), flexsp.Cluster(num_gpus, min(num_gpus, 8))
            pool = wiki[wiki <= cost.group_capacity(num_gpus)]
            for size in sizes:
                rng = np.random.default_rng(1000 * size + num_gpus)
                solve, hits, ratio = [], 0, []
                for _ in range(reps):
                    lengths = pool[rng.integers(0, pool.size, size=size)]
                    plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=PACE_TIME_LIMIT)
                    solve.append(plan.solve_time)
                    hits += bool(plan.meta.get("time_limit_hit"))
                    ratio.append(plan.predicted_time / lower_bound(lengths, cost, cluster))
                met = float(np.median(solve)) <= TARGET_PACE and hits == 0
                all_met &= met
                lines.append(f"| {name} | {num_gpus} | {size} | {np.median(solve) * 1e3:.1f} / {np.max(solve) * 1e3:.1f} | "
                             f"{hits} of {reps} | {np.mean(ratio):.4f} | {'met' if met else 'MISSED'} |")
    return "\n".join(lines), all_met


def past_the_limit(limit: float = 0.5) -> str:
    """Issue 21's hostile batches at 64 GPUs (gpt-7b, 384K): seconds each strategy's ``plan_batch``
    (validation included) runs past ``limit``, and the micro-batches its plan needs."""
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    cluster = flexsp.Cluster(64, 8)
    cases = {"3,000 x uniform 50K-390K": np.random.default_rng(0).integers(50_000, 390_000, size=3000),
             "20,000 x 3,204": np.full(20_000, 3204)}
    lines = [f"### Past the time limit ({limit} s) on batches needing thousands of micro-batches, 64 GPUs", "",
             "| batch | " + " | ".join(STRATEGY_NAMES) + " |", "|---|" + "---|" * len(STRATEGY_NAMES)]
    for name, lengths in cases.items():
        cells = []
        for strategy in STRATEGY_NAMES:
            started = time.perf_counter()
            plan = flexsp.plan_batch(lengths, cost, cluster, strategy, time_limit=limit)
            cells.append(f"{time.perf_counter() - started - limit:+.2f} s ({len(plan.micro_batches)} mb)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="CI mode: 2 batches of 128, tiny scaling")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown report (default: results/; a temporary file with --quick)")
    args = parser.parse_args()
    args.out = resolve_out(args.out, args.quick, Path(__file__).parent / "results" / "planner_benchmark.md")
    started = time.time()
    load, reference = os.getloadavg()[0], reference_loop(1 if args.quick else 3)
    if args.quick:
        table, summary = paper_setting(2, 128, args.time_limit)
        scale = scaling([16, 32], [128], reps=1, time_limit=args.time_limit)
        pace, _ = small_batches([4], [8, 32], reps=2, costs=dict(list(PACE_COSTS.items())[:1]))
    else:
        table, summary = paper_setting(args.batches, args.batch_size, args.time_limit)
        scale = scaling([16, 32, 64, 128, 256, 512, 1024], [128, 256, 512, 1024, 2048, 4096], reps=3,
                        time_limit=args.time_limit)
        pace, _ = small_batches([4, 8, 16], [8, 16, 32, 64], reps=5)
    limits = "(time-limit table: full mode only)" if args.quick else past_the_limit()
    text = (f"{LABEL} time_limit {args.time_limit:g} s (the wall-clock safety net; searches are bounded in work).\n\n{table}\n\n{scale}\n\n{pace}\n\n{limits}\n\n{machine_line(started, load, reference)}\n\n"
            f"<!-- generated: readme -->\n{readme_block(summary, load, reference)}<!-- end: readme -->\n")
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if not args.quick:
        append_history(f"gpt-7b, 64 GPUs, batch 512, time_limit {args.time_limit:g} s", "planner_benchmark",
                       summary["median_solve"],
                       summary["median_cpu"], load, reference)


if __name__ == "__main__":
    main()
