"""End-to-end speedup by simulation (FlexSP paper, Fig. 4): simulated, not measured.

Every time here is predicted by the paper's published cost model (``flexsp.cost_from_preset``: GPT
7B/13B/30B constants fitted on 64 x A100-40GB), the same model FlexSP optimises; the Megatron column
uses the analytic ``flexsp.evaluation.megatron`` model. FlexSP keeps the best of its own search and the
BatchAda and dynamic-CP plans (fallbacks in ``flexsp.plan.planner``; BatchAda tries every single degree,
static SP's among them) under that cost model, so its speedups over DeepSpeed, BatchAda and dynamic
CP are >= 1x by construction: they say how much better FlexSP's plans are *under the model*, not on
hardware.

GPT-7B / 13B / 30B x {GitHub, CommonCrawl, Wikipedia} x {192K, 384K} context on 64 GPUs, global
batch 512, 40 iterations (the paper's protocol). Every strategy plans the same seeded batches:
FlexSP, DeepSpeed-style static SP (64 and 32; the better feasible one counts), BatchAda, Megatron's
dynamic CP rule (``dynamic-cp``) and a Megatron-LM-style TP=8 + ring-attention CP baseline
(``flexsp.evaluation.megatron``). Speedup = baseline total time / FlexSP total time over all iterations.

    python experiments/e2e_speedup.py                  # full: 18 settings x 40 iterations (~15-20 min)
    python experiments/e2e_speedup.py --quick          # CI: gpt-7b, 384K, 1 batch of 64 per dataset
"""
from __future__ import annotations

import time
from pathlib import Path
from collections import Counter

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.evaluation.megatron import MegatronModel, megatron_step_time
from flexsp.evaluation.simulate import plan_steps
from flexsp.plan.bounds import lower_bound

try:
    from . import common
except ImportError:  # run as a script
    import common

SIMULATED = ("**Simulated, not measured**: every time is predicted by the paper's published cost model "
             "(`flexsp.cost_from_preset`, GPT-7B/13B/30B constants for 64 x A100-40GB), the model FlexSP "
             "optimises; Megatron's by the analytic model in `flexsp/evaluation/megatron.py`. FlexSP's candidates include "
             "BatchAda's and the dynamic-CP rule's plans (BatchAda tries every single degree, static SP's among them), "
             "so its speedups over DeepSpeed, BatchAda and dynamic CP are >= 1x by construction.")
BASELINES = ("megatron", "deepspeed", "batchada", "dynamic-cp")
COLUMNS = ["model", "context", "dataset", "approximate", "iterations", "batch_size",
           "flexsp_s", "megatron_s", "megatron_cp", "deepspeed_s", "deepspeed_degree", "batchada_s", "dynamic_cp_s",
           "speedup_megatron", "speedup_deepspeed", "speedup_batchada", "speedup_dynamic_cp",
           "flexsp_over_lower_bound", "flexsp_solve_mean_s"]


def run_setting(model: str, dataset: str, context: int, iterations: int, batch_size: int, num_gpus: int,
                time_limit: float, seed: int, bar: tqdm, draw_limit: int | None = None, workers: int = 1) -> dict:
    """Every strategy on the same ``iterations`` batches; totals in seconds. ``draw_limit`` (default
    ``context``) caps the lengths drawn, for clusters too small to hold a ``context``-long sequence.
    ``workers`` plans that many batches at once in separate processes (``flexsp.evaluation.simulate.plan_steps``)."""
    cost = flexsp.cost_from_preset(model, context=context, num_gpus=num_gpus)
    mega = MegatronModel.from_preset(model, context=context, num_gpus=num_gpus)
    cluster = flexsp.Cluster(num_gpus, 8)
    dist = common.distribution(dataset)
    strategies = ["flexsp", f"static:{num_gpus}", f"static:{num_gpus // 2}", "batchada", "dynamic-cp"]
    totals = {name: 0.0 for name in strategies}
    totals["megatron"], bound, solve = 0.0, 0.0, []
    cp_used: Counter = Counter()
    batches = list(common.batches(dist, iterations, batch_size, draw_limit or context, num_gpus, seed))
    planned = plan_steps(batches, cost, cluster, strategies, config=flexsp.PlanConfig(time_limit=time_limit),
                         workers=workers, keep_plans=0)
    for lengths, outcomes in zip(batches, planned):
        for name, outcome in zip(strategies, outcomes):
            if not np.isfinite(totals[name]):
                continue   # a static degree that failed once is out for the whole run
            ok = outcome.error is None and outcome.fatal is None
            totals[name] += outcome.predicted_time if ok else np.inf
            if name == "flexsp" and ok:
                solve.append(outcome.solve_time)
        step = megatron_step_time(lengths, mega, num_gpus)
        totals["megatron"] += step.time
        cp_used[step.cp] += 1
        bound += lower_bound(lengths, cost, cluster)
        bar.update(1)
    statics = {d: totals[f"static:{d}"] for d in (num_gpus, num_gpus // 2)}
    ds_degree = min(statics, key=statics.get)
    fx = totals["flexsp"]
    row = {"model": model, "context": f"{context // 1024}K", "dataset": dataset, "approximate": dist.approximate,
           "iterations": iterations, "batch_size": batch_size,
           "flexsp_s": fx, "megatron_s": totals["megatron"], "deepspeed_s": statics[ds_degree],
           "deepspeed_degree": ds_degree, "batchada_s": totals["batchada"], "dynamic_cp_s": totals["dynamic-cp"],
           "megatron_cp": " ".join(f"cp{c}x{n}" for c, n in sorted(cp_used.items())),
           "flexsp_over_lower_bound": fx / bound, "flexsp_solve_mean_s": float(np.mean(solve)),
           "flexsp_solve_max_s": float(np.max(solve))}
    for base, key in (("megatron", "megatron_s"), ("deepspeed", "deepspeed_s"), ("batchada", "batchada_s"),
                      ("dynamic_cp", "dynamic_cp_s")):
        row[f"speedup_{base}"] = row[key] / fx
    return row


def figure(rows: list[dict], models: list[str], contexts: list[int]):
    """The speedup figure (returned open, for tests to read its text); its title gives the batch size and
    iterations of ``rows``."""
    plt = common.pyplot()
    fig, axes = plt.subplots(len(contexts), len(models), figsize=(max(6.0, 4.2 * len(models)), 3.4 * len(contexts)),
                             squeeze=False, layout="constrained")
    series = [("megatron_s", "Megatron (TP8+CP)", "#7f7f7f"), ("deepspeed_s", "DeepSpeed (static SP)", "#1f77b4"),
              ("batchada_s", "BatchAda", "#ff7f0e"), ("dynamic_cp_s", "dynamic CP", "#9467bd"),
              ("flexsp_s", "FlexSP", "#2ca02c")]
    for i, context in enumerate(contexts):
        for j, model in enumerate(models):
            ax = axes[i][j]
            mine = [r for r in rows if r["model"] == model and r["context"] == f"{context // 1024}K"]
            x = np.arange(len(mine))
            width = 0.8 / len(series)
            for k, (key, name, color) in enumerate(series):
                values = [r[key] / r["iterations"] for r in mine]
                ax.bar(x + (k - len(series) / 2 + 0.5) * width, values, width, label=name, color=color)
            for xi, r in zip(x, mine):       # above the Megatron bar, the first of each group
                ax.text(xi + (0.5 - len(series) / 2) * width, r["megatron_s"] / r["iterations"],
                        f"{r['speedup_megatron']:.2f}x", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(x, [("*" if r["approximate"] else "") + r["dataset"] for r in mine], fontsize=8)
            ax.set_title(f"{model}, {context // 1024}K context", fontsize=9)
            ax.set_ylabel("mean iteration time (s)", fontsize=8)
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncol=len(series))
    batch = "/".join(str(b) for b in sorted({int(r["batch_size"]) for r in rows}))
    iterations = "/".join(str(n) for n in sorted({int(r["iterations"]) for r in rows}))
    fig.suptitle(common.wrap_title(
        f"Simulated iteration time, 64 GPUs, batch {batch}, {iterations} iteration(s) per setting (label: FlexSP "
        "speedup over Megatron; * = approximated length distribution)", fig.get_figwidth()), fontsize=9)
    return fig


def plot(rows: list[dict], models: list[str], contexts: list[int], path) -> None:
    common.save_figure(figure(rows, models, contexts), Path(path), Path(path).with_suffix(".csv"))


def summarize(rows: list[dict]) -> str:
    table_rows = []
    for r in rows:
        table_rows.append({
            "model": r["model"], "context": r["context"], "dataset": r["dataset"] + (" (approx.)" if r["approximate"] else ""),
            "FlexSP iter (s)": common.fmt(r["flexsp_s"] / r["iterations"]),
            "vs Megatron": common.fmt(r["speedup_megatron"], suffix="x") + f" ({r['megatron_cp']})",
            "vs DeepSpeed": common.fmt(r["speedup_deepspeed"], suffix="x") + f" (SP {r['deepspeed_degree']})",
            "vs BatchAda": common.fmt(r["speedup_batchada"], suffix="x"),
            "vs dynamic CP": common.fmt(r["speedup_dynamic_cp"], suffix="x"),
            "FlexSP / lower bound": common.fmt(r["flexsp_over_lower_bound"], 3)})
    cols = list(table_rows[0])
    summary = [{"baseline": name, "simulated max": common.fmt(max(r[f"speedup_{key}"] for r in rows), suffix="x"),
                "simulated min": common.fmt(min(r[f"speedup_{key}"] for r in rows), suffix="x"),
                "simulated geo-mean": common.fmt(float(np.exp(np.mean([np.log(r[f"speedup_{key}"]) for r in rows]))), suffix="x"),
                "paper max": f"{common.PAPER_MAX_SPEEDUP[paper]:.2f}x" if paper else "n/a (not in paper)"}
               for name, key, paper in (("Megatron-LM (TP8 + ring CP)", "megatron", "megatron"),
                                        ("DeepSpeed (static SP 64/32)", "deepspeed", "deepspeed"),
                                        ("BatchAda", "batchada", "batchada"),
                                        ("Megatron dynamic CP rule", "dynamic_cp", None))]
    return (common.markdown_table(summary, list(summary[0])) + "\n\n"
            + common.markdown_table(table_rows, cols))


def main() -> None:
    p = common.parser(__doc__, "e2e_speedup")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--time-limit", type=float, default=1.0, help="FlexSP solver time limit per batch (s)")
    p.add_argument("--models", nargs="+", default=list(common.MODELS))
    p.add_argument("--datasets", nargs="+", default=list(common.DATASETS))
    p.add_argument("--contexts", nargs="+", type=int, default=[192, 384], help="context limits in K tokens")
    args = common.parse(p)
    if args.replot:   # the figure from the CSV already written, without planning
        rows = common.read_csv(args.out / f"{args.stem}.csv")
        plot(rows, list(dict.fromkeys(r["model"] for r in rows)),
             list(dict.fromkeys(int(r["context"][:-1]) * 1024 for r in rows)), args.out / f"{args.stem}.png")
        return
    if args.quick:
        args.iterations, args.batch_size, args.time_limit = 1, 64, 0.2
        args.models, args.contexts = ["gpt-7b"], [384]
    started = time.time()
    contexts = [c * 1024 for c in args.contexts]
    settings = [(m, c, d) for m in args.models for c in contexts for d in args.datasets]
    rows = []
    with tqdm(total=len(settings) * args.iterations, desc="e2e speedup", disable=args.no_progress) as bar:
        for model, context, dataset in settings:
            bar.set_postfix_str(f"{model} {context // 1024}K {dataset}")
            rows.append(run_setting(model, dataset, context, args.iterations, args.batch_size, 64,
                                    args.time_limit, args.seed, bar, workers=args.workers))
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out / f"{args.stem}.csv", rows, COLUMNS)
    plot(rows, args.models, contexts, args.out / f"{args.stem}.png")
    body = (f"64 GPUs (8 x 8), global batch {args.batch_size}, {args.iterations} iterations per setting, "
            f"FlexSP time limit {args.time_limit} s per batch; speedup = baseline total / FlexSP total over the "
            "same batches. DeepSpeed = the better of static SP 64 and 32 (32 cannot hold batches with a "
            "sequence above 32 x token capacity and then counts as infeasible). Megatron column: CP sizes "
            "chosen per batch (cpC x iterations).\n\n" + summarize(rows) + "\n\nLength distributions:\n"
            + common.provenance(args.datasets))
    common.write_markdown(args.out / f"{args.stem}.md", "End-to-end speedup (paper Fig. 4), simulated", body, started, args.quick,
                         label=SIMULATED)
    print((args.out / f"{args.stem}.md").read_text())


if __name__ == "__main__":
    main()
