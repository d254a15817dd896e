"""Scalability by simulation (FlexSP paper, Fig. 6): FlexSP's speedup over the baselines as the
cluster and the context grow, and the solver time at each size.

- GPUs: 16 / 32 / 64 at 128K context (global batch 512). A cluster that cannot hold a 128K-token
  sequence at all (16 GPUs of GPT-7B hold ~84K tokens) draws only lengths it can hold; the table
  says so.
- Context: 64 GPUs at 64K, 128K, 192K, 256K and 384K.
- Beyond the paper: 256 and 1024 GPUs at 384K (global batch 8 x N, at most 4096). The paper's
  bandwidth table stops at 64 GPUs; the presets reuse the 64-GPU value above it (labelled).
  Model parameters at contexts other than 192K / 384K are linearly inter-/extrapolated (presets).

Speedups use ``e2e_speedup.run_setting`` (same baselines and definitions as Fig. 4).

    python experiments/scalability.py            # 10 iterations per point
    python experiments/scalability.py --quick    # 1 small batch per point, fewer points
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp

try:
    from . import common
    from .e2e_speedup import run_setting
except ImportError:  # run as a script
    import common
    from e2e_speedup import run_setting

COLUMNS = ["sweep", "num_gpus", "context", "draw_limit", "dataset", "approximate", "batch_size", "iterations",
           "flexsp_s", "speedup_megatron", "speedup_deepspeed", "deepspeed_degree", "speedup_batchada",
           "speedup_dynamic_cp", "flexsp_over_lower_bound", "flexsp_solve_mean_s", "flexsp_solve_max_s", "bandwidth"]


def draw_limit(model: str, context: int, num_gpus: int) -> int:
    """The context, or the longest padded length the whole cluster can hold if that is shorter."""
    capacity = flexsp.cost_from_preset(model, context=context, num_gpus=num_gpus).token_capacity * num_gpus
    limit = min(context, int(capacity))
    return limit - limit % (2 * num_gpus)


def main() -> None:
    p = common.parser(__doc__, "scalability")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--time-limit", type=float, default=1.0)
    p.add_argument("--model", default="gpt-7b")
    p.add_argument("--dataset", default="wikipedia")
    args = common.parse(p)
    if args.replot:   # the figure from the CSV already written, without planning
        rows = common.read_csv(args.out / f"{args.stem}.csv")
        plot(rows, args.out / f"{args.stem}.png", common.label(common.distribution(rows[0]["dataset"])), args.model)
        return
    gpu_sweep, context_sweep, large = [16, 32, 64], [64, 128, 192, 256, 384], [256, 1024]
    batch = 512
    if args.quick:
        args.iterations, args.time_limit, batch = 1, 0.2, 64
        gpu_sweep, context_sweep, large = [16, 64], [64, 384], [256]
    points = ([("GPUs @128K", n, 128 * 1024, batch) for n in gpu_sweep]
              + [("context @64 GPUs", 64, c * 1024, batch) for c in context_sweep]
              + [("large clusters @384K", n, 384 * 1024, batch if args.quick else min(8 * n, 4096)) for n in large])
    started = time.time()
    rows = []
    dist = common.distribution(args.dataset)
    with tqdm(total=len(points) * args.iterations, desc="scalability", disable=args.no_progress) as bar:
        for sweep, n, context, size in points:
            bar.set_postfix_str(f"{n} GPUs {context // 1024}K")
            limit = draw_limit(args.model, context, n)
            row = run_setting(args.model, args.dataset, context, args.iterations, size, n, args.time_limit,
                              args.seed, bar, draw_limit=limit, workers=args.workers)
            row.update(sweep=sweep, num_gpus=n, context=f"{context // 1024}K", draw_limit=limit,
                       bandwidth="published" if n <= 64 else "64-GPU value reused above 64 (assumption)")
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out / f"{args.stem}.csv", rows, COLUMNS)
    plot(rows, args.out / f"{args.stem}.png", common.label(dist), args.model)
    shown = [{"sweep": r["sweep"], "GPUs": r["num_gpus"], "context": r["context"]
              + ("" if r["draw_limit"] >= int(r["context"][:-1]) * 1024 else f" (lengths <= {r['draw_limit']:,}: cluster limit)"),
              "batch": r["batch_size"], "FlexSP iter (s)": common.fmt(r["flexsp_s"] / r["iterations"]),
              "vs Megatron": common.fmt(r["speedup_megatron"], suffix="x"),
              "vs DeepSpeed": common.fmt(r["speedup_deepspeed"], suffix="x") + f" (SP {r['deepspeed_degree']})",
              "vs BatchAda": common.fmt(r["speedup_batchada"], suffix="x"),
              "vs dynamic CP": common.fmt(r["speedup_dynamic_cp"], suffix="x"),
              "FlexSP / LB": common.fmt(r["flexsp_over_lower_bound"], 3),
              "solve mean / max (s)": f"{r['flexsp_solve_mean_s']:.2f} / {r['flexsp_solve_max_s']:.2f}",
              "bandwidth": r["bandwidth"]} for r in rows]
    body = (f"{args.model}, {common.label(dist)}, {args.iterations} iterations per point, FlexSP time limit "
            f"{args.time_limit} s (solve times at the limit mean the search was cut there; the best plan so far is "
            "used).\n\n" + common.markdown_table(shown, list(shown[0]))
            + "\n\nLength distribution:\n" + common.provenance([args.dataset]))
    common.write_markdown(args.out / f"{args.stem}.md", "Scalability (paper Fig. 6)", body, started, args.quick)
    print((args.out / f"{args.stem}.md").read_text())


def figure(rows: list[dict], dataset: str, model: str):
    """The scalability figure (returned open, for tests to read its text)."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    keys = [("speedup_megatron", "vs Megatron"), ("speedup_deepspeed", "vs DeepSpeed"),
            ("speedup_batchada", "vs BatchAda"), ("speedup_dynamic_cp", "vs dynamic CP")]
    by_gpus = [r for r in rows if r["sweep"] != "context @64 GPUs"]
    by_gpus = sorted({r["num_gpus"]: r for r in by_gpus}.values(), key=lambda r: r["num_gpus"])
    by_context = [r for r in rows if r["sweep"] == "context @64 GPUs"]
    for ax, subset, xkey, xlabel in ((axes[0], by_gpus, "num_gpus", "GPUs (128K up to 64 GPUs, 384K above)"),
                                     (axes[1], by_context, "context", "context (64 GPUs)")):
        x = np.arange(len(subset))
        for key, name in keys:
            ax.plot(x, [r[key] for r in subset], marker="o", label=name)
        ax.set_xticks(x, [str(r[xkey]) for r in subset])
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set(xlabel=xlabel, ylabel="FlexSP speedup")
    axes[0].legend(fontsize=7)
    gpus = sorted({r["num_gpus"]: r for r in rows}.values(), key=lambda r: r["num_gpus"])
    axes[2].plot([r["num_gpus"] for r in gpus], [r["flexsp_solve_mean_s"] for r in gpus], marker="o", label="mean")
    axes[2].plot([r["num_gpus"] for r in gpus], [r["flexsp_solve_max_s"] for r in gpus], marker="s", label="max")
    common.log_axis(axes[2], [r["num_gpus"] for r in gpus])
    axes[2].set(xlabel="GPUs", ylabel="FlexSP solve time per batch (s)")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Simulated, {model}, {dataset}: speedup and solver time (>64 GPUs: bandwidth extrapolated)",
                 fontsize=9)
    return fig


def plot(rows: list[dict], path, dataset: str, model: str) -> None:
    common.save_figure(figure(rows, dataset, model), Path(path), Path(path).with_suffix(".csv"))


if __name__ == "__main__":
    main()
