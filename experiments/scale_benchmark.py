"""Planning at cluster scale (issues 10, 16, 21): N = 64 .. 16,384 GPUs, batches of 8 x N, 2M context.

Three settings:

* ``wikipedia`` and ``long-mix``: an analytic LLaMA-7B-shaped model (32 heads, so degrees above 32
  are Ulysses x ring hybrids) on H100-80GB nodes of 8 with one 400 Gb/s NIC per GPU, ZeRO-3;
  the bundled Wikipedia lengths, and for ``long-mix`` long sequences log-uniform in [256K, 2M]
  (capped at 90% of what the cluster can hold) carrying about a third of the tokens; lengths padded
  to a multiple of 2 x N;
* ``gpt-7b-constants``: the paper's gpt-7b constants (``flexsp.cost_from_preset``), ZeRO-3 capacity
  recomputed for N (about 6,850 tokens per GPU at 16,384), all-to-all bandwidth above 64 GPUs held
  at the 64-GPU figure, Wikipedia lengths rounded up to 128.

``plan_batch`` runs with its default ``time_limit`` (2 s) unless ``--time-limit`` is given; the baselines it is
compared with run to their end (``BASELINE_TIME_LIMIT``). Prints
median / max solve time of FlexSP, plan / lower bound for both bounds of ``flexsp.plan.bounds`` (the
simple one and the coupled LP one) and, at the largest size, for ``flexsp.plan.refined_bound``, FlexSP's
speedup over batchada, static (largest degree) and dynamic-cp, and whether the targets hold (issue 16: plan /
simple bound <= 1.10 from 1,024 GPUs; issue 43 at 16,384: median solve <= 0.5 s at mean plan / coupled bound
<= 1.05, with the simple bound's verdict beside it; wall and CPU medians, a full run appends
them to results/solve_time_history.md); then how far each strategy runs past a 0.5 s ``time_limit`` at the
largest size (the constant of issue 21); then, at one size, communicators per rank against plan
time for restricted degree sets. ``--quick`` runs N = 64 and 256 only.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.plan.analytic import analytic_cost_model
from flexsp.plan.bounds import coupled_lower_bound, lower_bound
from flexsp.plan.refined_bound import refined_lower_bound
from flexsp.plan.lengths import get_distribution, preprocess
from flexsp.plan.strategies import names as strategy_names
from outputs import resolve_out  # noqa: E402
from planner_benchmark import append_history, machine_line, reference_loop, speed_note  # noqa: E402

CONTEXT = 2 * 1024 * 1024
MIXES = ("wikipedia", "long-mix", "gpt-7b-constants")
TARGET_RATIO = 1.10                        # issue 16: plan / lower bound <= 1.10 from 1,024 GPUs
# issue 43 at 16,384 GPUs: median solve <= 0.5 s (issue 27's was 1 s) at mean plan / lower bound <= 1.05, judged on the
# coupled bound: the issue quoted the previous release at 1.080, the coupled column's figure then (the simple one read
# 1.086). The simple bound's ratio gets its verdict beside it; the refined bound (flexsp.plan.refined_bound, 2-6 s a
# batch, so at the largest size only) says how much of what is left is the bounds' and not the plans'
TARGET_SOLVE, TARGET_RATIO_LARGEST = 0.5, 1.05
# The baselines FlexSP is compared with get all the time they need: under the 2 s default, batchada was cut
# short at 16,384 GPUs on a slow day (Wikipedia: 1.32x "faster" than it, 1.19x when it finishes).
BASELINE_TIME_LIMIT = 120.0
LABEL = ("Plan times are **simulated**: an analytic LLaMA-7B on H100-80GB nodes (`flexsp.plan.analytic`) for "
         "`wikipedia` and `long-mix`, the paper's gpt-7b constants (`flexsp.cost_from_preset`) for `gpt-7b-constants`; "
         "solve times are **measured** on this project's 2-core shared CPU.")
README_FROM = 1024   # the README shows the sizes the targets are about


def readme_block(header: list[str], lines: list[str], gpus: list[int], load: float,
                 reference: float | None = None) -> str:
    """The README's table (``<!-- generated: readme -->``): rows from ``README_FROM`` GPUs (all in --quick)."""
    keep = [line for line, n in zip(lines, gpus) if n >= README_FROM] or lines
    return "\n".join([f"{LABEL} {speed_note(load, reference)}", "", *header, *keep, ""])


def setting(mix: str, num_gpus: int) -> tuple[flexsp.CostModel, flexsp.Cluster]:
    cluster = flexsp.Cluster(num_gpus, 8)
    if mix == "gpt-7b-constants":
        return flexsp.cost_from_preset("gpt-7b", num_gpus=num_gpus), cluster
    return analytic_cost_model("llama-7b", "h100-80gb", num_gpus=num_gpus), cluster


def draw(mix: str, size: int, cost: flexsp.CostModel, cluster: flexsp.Cluster, rng: np.random.Generator) -> np.ndarray:
    wiki = get_distribution("wikipedia").lengths
    if mix == "gpt-7b-constants":
        pool = wiki[wiki <= CONTEXT]
        return -(-pool[rng.integers(0, pool.size, size=size)] // 128) * 128
    room = int(0.9 * cost.token_capacity * cluster.degrees[-1])
    pool = wiki[wiki <= min(CONTEXT, room)]
    lengths = pool[rng.integers(0, pool.size, size=size)]
    if mix == "long-mix":
        top = min(CONTEXT, room)
        long_mean = (top - 256 * 1024) / np.log(top / (256 * 1024)) if top > 256 * 1024 else top
        count = max(1, int(round(0.5 * lengths.sum() / long_mean)))     # long ~ 1/3 of all tokens
        longs = np.exp(rng.uniform(np.log(min(256 * 1024, top)), np.log(top), size=count)).astype(np.int64)
        lengths[rng.choice(size, size=count, replace=False)] = longs
    return preprocess(lengths, CONTEXT, cluster.num_gpus)[0]


def row(mix: str, num_gpus: int, reps: int, time_limit: float | None, refine: bool = False) -> tuple[str, dict]:
    """One table row; ``refine``: also the refined bound (seconds a batch, so the benchmark asks at its largest size)."""
    cost, cluster = setting(mix, num_gpus)
    limit = {} if time_limit is None else {"time_limit": time_limit}
    rng = np.random.default_rng(num_gpus)
    solve, cpu, ratio, coupled, refined = [], [], [], [], []
    speed = {"batchada": [], "static": [], "dynamic-cp": []}
    for _ in range(reps):
        lengths = draw(mix, 8 * num_gpus, cost, cluster, rng)
        cpu_started = time.process_time()
        plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", validate=False, **limit)
        cpu.append(time.process_time() - cpu_started)          # the same span as plan.solve_time
        plan.validate(lengths, cost, cluster)
        solve.append(plan.solve_time)
        ratio.append(plan.predicted_time / lower_bound(lengths, cost, cluster))
        coupled.append(plan.predicted_time / coupled_lower_bound(lengths, cost, cluster))
        if refine:
            refined.append(plan.predicted_time / refined_lower_bound(lengths, cost, cluster))
        for name in speed:   # each baseline searched to its end: a cut-short one would flatter FlexSP
            other = flexsp.plan_batch(lengths, cost, cluster, name, time_limit=BASELINE_TIME_LIMIT)
            if other.meta.get("time_limit_hit"):
                raise SystemExit(f"{name} at {num_gpus} GPUs hit its {BASELINE_TIME_LIMIT} s limit: raise BASELINE_TIME_LIMIT")
            speed[name].append(other.predicted_time / plan.predicted_time)
    result = {"mix": mix, "gpus": num_gpus, "median_solve": float(np.median(solve)), "median_cpu": float(np.median(cpu)),
              "ratio": float(np.mean(ratio)),
              "max_ratio": float(np.max(ratio)), "coupled": float(np.mean(coupled)),
              "refined": float(np.mean(refined)) if refined else None}
    verdicts = []
    if num_gpus >= 1024:
        verdicts.append("met" if result["max_ratio"] <= TARGET_RATIO else "**MISSED**")
    if num_gpus >= 16384:
        verdicts.append(f"solve {'met' if result['median_solve'] <= TARGET_SOLVE else '**MISSED**'}")
        verdicts.append(f"mean ratio {'met' if result['coupled'] <= TARGET_RATIO_LARGEST else '**MISSED**'} "
                        f"(on the simple bound: {'met' if result['ratio'] <= TARGET_RATIO_LARGEST else '**MISSED**'})")
    line = (f"| {mix} | {num_gpus:,} | {8 * num_gpus:,} | {np.median(solve):.2f} / {np.max(solve):.2f} | "
            f"{np.median(cpu):.2f} | "
            f"{np.mean(ratio):.3f} (max {np.max(ratio):.3f}) | {np.mean(coupled):.3f} (max {np.max(coupled):.3f}) | "
            + (f"{np.mean(refined):.3f} (max {np.max(refined):.3f}) | " if refined else "- | ")
            + " | ".join(f"{np.mean(v):.2f}x" for v in speed.values()) + f" | {', '.join(verdicts) or '-'} |")
    return line, result


def overrun(num_gpus: int, limit: float = 0.5) -> str:
    """Seconds each strategy's ``plan_batch`` (validation included) runs past ``limit``."""
    cost, cluster = setting("gpt-7b-constants", num_gpus)
    lengths = draw("gpt-7b-constants", 8 * num_gpus, cost, cluster, np.random.default_rng(1))
    cells = []
    for name in strategy_names():
        started = time.perf_counter()
        flexsp.plan_batch(lengths, cost, cluster, name, time_limit=limit)
        cells.append(f"{time.perf_counter() - started - limit:+.2f}")
    return (f"### Past the time limit: plan_batch wall time minus time_limit={limit} s, gpt-7b-constants, "
            f"{num_gpus:,} GPUs, {8 * num_gpus:,} sequences\n\n| " + " | ".join(strategy_names()) + " |\n|"
            + "---|" * len(strategy_names()) + "\n| " + " | ".join(cells) + " |")


def restrictions(num_gpus: int, reps: int, time_limit: float | None) -> str:
    cluster = flexsp.Cluster(num_gpus, 8)
    cost = analytic_cost_model("llama-7b", "h100-80gb", num_gpus=num_gpus)
    top = cluster.degrees[-1]
    sets = [None] + [tuple(sorted({d for d in s if d <= top} | {top}))
                     for s in ((1, 2, 4, 8, 64, 512), (1, 8, 64, 512), (1, 8, 128), (1,))]
    rng = np.random.default_rng(7)
    batches = [draw("long-mix", 8 * num_gpus, cost, cluster, rng) for _ in range(reps)]
    lines = [f"### Restricted degrees at {num_gpus} GPUs (long-mix): communicators per rank vs plan time", "",
             "| degrees | communicators per rank | plan time / unrestricted |", "|---|---|---|"]
    base = None
    for degrees in sets:
        limit = {} if time_limit is None else {"time_limit": time_limit}
        times = [flexsp.plan_batch(x, cost, cluster, "flexsp", degrees=degrees, **limit).predicted_time
                 for x in batches]
        base = base or times
        used = cluster.degrees if degrees is None else degrees
        lines.append(f"| {'all' if degrees is None else ','.join(map(str, degrees))} | {sum(d > 1 for d in used)} | "
                     f"{np.mean(np.array(times) / np.array(base)):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=None, help="default: plan_batch's own (2 s)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown report (default: results/; a temporary file with --quick)")
    args = parser.parse_args()
    args.out = resolve_out(args.out, args.quick, Path(__file__).parent / "results" / "scale_benchmark.md")
    sizes = [64, 256] if args.quick else [64, 256, 1024, 4096, 16384]
    reps = 1 if args.quick else args.reps
    started = time.time()
    load, reference = os.getloadavg()[0], reference_loop(1 if args.quick else 3)
    limit = "default 2 s" if args.time_limit is None else f"{args.time_limit:g} s"
    header = ["| setting | GPUs | batch | solve median / max, wall (s) | solve median, CPU (s) | plan / lower bound | "
              "plan / coupled bound | plan / refined bound | vs batchada | vs static | vs dynamic-cp | "
              f"target (max <= {TARGET_RATIO} from 1,024; wall median <= {TARGET_SOLVE:g} s and mean plan / "
              f"coupled bound <= {TARGET_RATIO_LARGEST} at 16,384) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points = [(m, n) for m in MIXES for n in sizes]
    results = [row(mix, n, reps, args.time_limit, refine=n == sizes[-1]) for mix, n in tqdm(points, desc="scale")]
    rows = [line for line, _ in results]
    lines = [LABEL, "", f"### FlexSP at scale: batch 8 x N, context 2M, time_limit {limit} (the baselines it is compared with: "
             f"{BASELINE_TIME_LIMIT:g} s, run to their end)", "", *header, *rows]
    text = "\n".join(lines) + "\n\n" + overrun(sizes[-1]) + "\n\n" + restrictions(256 if args.quick else 4096, reps, args.time_limit)
    text += f"\n\n{machine_line(started, load, reference)}\n"
    text += f"\n<!-- generated: readme -->\n{readme_block(header, rows, [n for _, n in points], load, reference)}<!-- end: readme -->\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if not args.quick:
        for _, result in results:
            if result["gpus"] == sizes[-1]:
                append_history(f"{result['mix']}, {sizes[-1]:,} GPUs, batch {8 * sizes[-1]:,}, time_limit {limit}",
                               "scale_benchmark",
                               result["median_solve"], result["median_cpu"], load, reference)


if __name__ == "__main__":
    main()
