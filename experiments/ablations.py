"""Ablations of the FlexSP search: what sorting, bucketing and the bucket count buy.

Each variant runs our search (``solver.search.BatchSearch``: blaster candidates, makespan sweep,
local search) *without* the baseline fallbacks that ``plan_batch("flexsp")`` adds, so a worse
component shows up instead of being hidden by a BatchAda / dynamic-CP plan. Variants:

- ``default``: DP bucketing, 16 buckets, lengths sorted longest first before the blaster;
- ``no sorting``: the blaster cuts the batch in arrival (random) order; the makespan sweep does not
  use the order, so the full search is also shown blaster-only (``greedy``, the paper's blaster);
- ``naive bucketing``: equal-width buckets (``solver.bucketing.naive_buckets``) instead of the DP;
- ``no bucketing``: one bucket per distinct length;
- ``B buckets``: DP with 4 / 8 / 32 / 64 buckets.

Quality = plan time / lower bound (``flexsp.plan.bounds.lower_bound``); solve time is
wall-clock. Sorting and the bucketing rule are options of the search
(``SearchOptions.sort_longest_first``, ``SearchOptions.bucketing``).

    python experiments/ablations.py            # 5 batches x 3 datasets
    python experiments/ablations.py --quick    # 1 batch of 64, Wikipedia
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.plan.bounds import lower_bound
from flexsp.plan.planner import place
from solver.search import BatchSearch, SearchOptions

try:
    from . import common
except ImportError:  # run as a script
    import common

MODEL, CONTEXT, NUM_GPUS = "gpt-7b", 384 * 1024, 64
COLUMNS = ["dataset", "approximate", "variant", "pipeline", "num_buckets", "plan_over_lower_bound",
           "plan_over_default", "solve_mean_s", "solve_max_s", "batches"]


def run_search(lengths: np.ndarray, cost: flexsp.CostModel, cluster: flexsp.Cluster, options: SearchOptions,
               greedy_only: bool, time_limit: float) -> tuple[float, float]:
    """(plan time, solve seconds) of the search alone, validated as a placed plan."""
    started = time.perf_counter()
    costs = cost.degree_costs(cluster.degrees)
    search = BatchSearch(lengths, costs, cluster.num_gpus, options, started + time_limit)
    candidates = [search.schedule(search.first_split())]
    if not greedy_only and not search.out_of_time():
        split = search.best_split()
        candidates.append(search.schedule(split))
        if not search.out_of_time():
            candidates.append(search.schedule(search.improve(split)))
    best = min(candidates, key=lambda s: s.time(lengths, costs))
    solve = time.perf_counter() - started
    plan = flexsp.Plan(num_gpus=cluster.num_gpus, micro_batches=place(best), predicted_time=best.time(lengths, costs),
                       gpus_per_node=cluster.gpus_per_node)
    plan.validate(lengths, cost, cluster)
    return plan.predicted_time, solve


def variants(num_distinct: int) -> list[tuple[str, str, dict, bool]]:
    """(variant, pipeline, SearchOptions fields, blaster only)."""
    unsorted = {"num_buckets": 16, "sort_longest_first": False}
    out = [("default (DP, 16, sorted)", "full search", {"num_buckets": 16}, False),
           ("no sorting", "full search", unsorted, False),
           ("default (DP, 16, sorted)", "blaster only (greedy)", {"num_buckets": 16}, True),
           ("no sorting", "blaster only (greedy)", unsorted, True),
           ("naive bucketing", "full search", {"num_buckets": 16, "bucketing": "naive"}, False),
           ("no bucketing", "full search", {"num_buckets": num_distinct}, False)]
    out += [(f"{b} buckets", "full search", {"num_buckets": b}, False) for b in (4, 8, 32, 64)]
    return out


def main() -> None:
    p = common.parser(__doc__, "ablations")
    common.batch_options(p, batches=5, time_limit=2.0)
    args = common.parse(p)
    if common.replotted(args, lambda rows, png: plot(rows, list(dict.fromkeys(r["dataset"] for r in rows)), png)):
        return
    if args.quick:
        args.batches, args.batch_size, args.time_limit, args.datasets = 1, 64, 0.2, ["wikipedia"]
    started = time.time()
    cost = flexsp.cost_from_preset(MODEL, context=CONTEXT, num_gpus=NUM_GPUS)
    cluster = flexsp.Cluster(NUM_GPUS, 8)
    rows = []
    total = len(args.datasets) * args.batches * len(variants(0))
    with tqdm(total=total, desc="ablations", disable=args.no_progress) as bar:
        for dataset in args.datasets:
            dist = common.distribution(dataset)
            acc: dict[tuple[str, str], dict] = {}
            for lengths in common.batches(dist, args.batches, args.batch_size, CONTEXT, NUM_GPUS, args.seed):
                bound = lower_bound(lengths, cost, cluster)
                for name, pipeline, fields, greedy_only in variants(len(np.unique(lengths))):
                    options = SearchOptions(**fields)
                    buckets = options.num_buckets
                    plan_time, solve = run_search(lengths, cost, cluster, options, greedy_only, args.time_limit)
                    a = acc.setdefault((name, pipeline), {"ratio": [], "solve": [], "buckets": [], "time": []})
                    a["ratio"].append(plan_time / bound)
                    a["time"].append(plan_time)
                    a["solve"].append(solve)
                    a["buckets"].append(buckets)
                    bar.update(1)
            for (name, pipeline), a in acc.items():
                reference = acc[("default (DP, 16, sorted)", pipeline)]["time"]
                rows.append({"dataset": dataset, "approximate": dist.approximate, "variant": name, "pipeline": pipeline,
                             "num_buckets": (f"{min(a['buckets'])}-{max(a['buckets'])}" if name == "no bucketing"
                                             else a["buckets"][0]),
                             "plan_over_lower_bound": round(float(np.mean(a["ratio"])), 4),
                             "plan_over_default": round(float(np.sum(a["time"]) / np.sum(reference)), 4),
                             "solve_mean_s": round(float(np.mean(a["solve"])), 3),
                             "solve_max_s": round(float(np.max(a["solve"])), 3), "batches": args.batches})
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out / f"{args.stem}.csv", rows, COLUMNS)
    plot(rows, args.datasets, args.out / f"{args.stem}.png")
    shown = [{"dataset": r["dataset"] + (" (approx.)" if r["approximate"] else ""), "variant": r["variant"],
              "pipeline": r["pipeline"], "buckets": r["num_buckets"],
              "plan / lower bound": f"{r['plan_over_lower_bound']:.3f}",
              "plan / default": f"{r['plan_over_default']:.3f}",
              "solve mean / max (s)": f"{r['solve_mean_s']:.2f} / {r['solve_max_s']:.2f}"} for r in rows]
    body = (f"{MODEL}, {NUM_GPUS} GPUs, {CONTEXT // 1024}K context, {args.batches} batches of {args.batch_size} per "
            f"dataset, search time limit {args.time_limit} s, no baseline fallbacks (see the script's docstring). "
            "plan / default compares with the default variant of the same pipeline.\n\n"
            + common.markdown_table(shown, list(shown[0])) + "\n\nLength distributions:\n"
            + common.provenance(args.datasets))
    common.write_markdown(args.out / f"{args.stem}.md", "Ablations: sorting, bucketing, bucket count", body, started,
                          args.quick)
    print((args.out / f"{args.stem}.md").read_text())


def figure(rows: list[dict], datasets: list[str]):
    """The bucket-count figure (returned open, for tests to read its text)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    sweep = [r for r in rows if r["pipeline"] == "full search" and (r["variant"].endswith("buckets")
                                                                   or r["variant"].startswith("default"))]
    for dataset in datasets:
        mine = sorted((r for r in sweep if r["dataset"] == dataset), key=lambda r: int(r["num_buckets"]))
        x = [int(r["num_buckets"]) for r in mine]
        axes[0].plot(x, [r["plan_over_lower_bound"] for r in mine], marker="o", label=dataset)
        axes[1].plot(x, [r["solve_mean_s"] for r in mine], marker="o", label=dataset)
    for ax, ylabel in ((axes[0], "plan / lower bound"), (axes[1], "solve time per batch (s)")):
        common.log_axis(ax, [4, 8, 16, 32, 64])
        ax.set(xlabel="DP buckets", ylabel=ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(common.wrap_title(f"Simulated, {MODEL}, {NUM_GPUS} GPUs, {CONTEXT // 1024}K: bucket count vs plan "
                                   "quality and solve time (search only; github/commoncrawl are approximations)", 11),
                 fontsize=9)
    return fig


def plot(rows: list[dict], datasets: list[str], path) -> None:
    common.save_figure(figure(rows, datasets), Path(path), Path(path).with_suffix(".csv"))


if __name__ == "__main__":
    main()
