"""Case study (FlexSP paper, Table 3 and Fig. 5): which SP groups each strategy forms, and how
much of the step is all-to-all communication.

GPT-7B, CommonCrawl (our approximation of it), 384K context, 64 GPUs, global batch 512.

Table 3: for the first batch, every micro-batch of every strategy as the multiset of its group
degrees, written ``DxK`` = K groups of degree D (e.g. ``1x40, 2x8, 8x1``).

All-to-all share, over ``--batches`` batches. A micro-batch lasts as long as its slowest group (the
critical group); each group's time splits into compute ``(alpha1 s^2 + alpha2 s)/d``, all-to-all
``comm_bytes_per_token * s / d / bandwidth[d]`` and the fixed ``beta1``. We report

- **critical-path share** (the figure): sum over micro-batches of the critical group's all-to-all
  time / the sum of the critical groups' times (= the step time);
- **GPU-time share**: all-to-all GPU-seconds (time x degree) of every group / all busy GPU-seconds,
  which also counts groups off the critical path.

    python experiments/case_study.py            # 10 batches
    python experiments/case_study.py --quick    # 1 batch of 128
"""
from __future__ import annotations

import time
from pathlib import Path
from collections import Counter

import numpy as np
from tqdm import tqdm

import flexsp

try:
    from . import common
except ImportError:  # run as a script
    import common

MODEL, DATASET, CONTEXT, NUM_GPUS = "gpt-7b", "commoncrawl", 384 * 1024, 64
COLUMNS = ["strategy", "step_time_s", "critical_compute_s", "critical_a2a_s", "critical_overhead_s",
           "a2a_share_critical", "a2a_share_gpu_time", "paper_a2a_share"]
TABLE3_COLUMNS = ["strategy", "micro_batch", "groups", "time_s"]


def group_parts(lengths: np.ndarray, degree: int, cost: flexsp.CostModel) -> tuple[float, float, float]:
    """(compute, all-to-all, fixed overhead) seconds of one group."""
    s = lengths.astype(np.float64)
    compute = float(((cost.alpha1 * s * s + cost.alpha2 * s) / degree).sum())
    comm = 0.0 if degree == 1 else float((cost.alltoall_bytes(degree) * s / degree / cost.bandwidth(degree)).sum())
    return compute, comm, cost.beta1


def degrees_text(mb: flexsp.MicroBatch) -> str:
    counts = Counter(g.degree for g in mb.groups)
    return ", ".join(f"{d}x{counts[d]}" for d in sorted(counts))


def analyse(plan: flexsp.Plan, lengths: np.ndarray, cost: flexsp.CostModel) -> dict:
    crit = np.zeros(3)
    gpu_comm = gpu_busy = 0.0
    for mb in plan.micro_batches:
        parts = [group_parts(lengths[list(g.seq_ids)], g.degree, cost) for g in mb.groups]
        slowest = max(range(len(parts)), key=lambda j: sum(parts[j]))
        crit += parts[slowest]
        for g, (c, a, o) in zip(mb.groups, parts):
            gpu_comm += a * g.degree
            gpu_busy += (c + a + o) * g.degree
    return {"critical": crit, "gpu_comm": gpu_comm, "gpu_busy": gpu_busy}


def main() -> None:
    p = common.parser(__doc__, "case_study")
    common.batch_options(p, batches=10, time_limit=1.0, datasets=False)
    args = common.parse(p)
    if common.replotted(args, lambda rows, png: plot(rows, png, args.batches)):
        return
    if args.quick:
        args.batches, args.batch_size, args.time_limit = 1, 128, 0.2
    started = time.time()
    cost = flexsp.cost_from_preset(MODEL, context=CONTEXT, num_gpus=NUM_GPUS)
    cluster = flexsp.Cluster(NUM_GPUS, 8)
    dist = common.distribution(DATASET)
    strategies = {"DeepSpeed (static SP 64)": f"static:{NUM_GPUS}", "DeepSpeed (static SP 32)": f"static:{NUM_GPUS // 2}",
                  "BatchAda": "batchada", "dynamic CP": "dynamic-cp", "FlexSP": "flexsp"}
    paper = {"DeepSpeed (static SP 64)": common.PAPER_A2A_SHARE["deepspeed"],
             "DeepSpeed (static SP 32)": common.PAPER_A2A_SHARE["deepspeed"],
             "BatchAda": common.PAPER_A2A_SHARE["batchada"], "FlexSP": common.PAPER_A2A_SHARE["flexsp"]}
    acc = {name: {"critical": np.zeros(3), "gpu_comm": 0.0, "gpu_busy": 0.0, "ok": True} for name in strategies}
    table3 = []
    with tqdm(total=args.batches * len(strategies), desc="case study", disable=args.no_progress) as bar:
        for b, lengths in enumerate(common.batches(dist, args.batches, args.batch_size, CONTEXT, NUM_GPUS, args.seed)):
            for name, strategy in strategies.items():
                bar.update(1)
                plan = common.plan_time(lengths, cost, cluster, strategy, args.time_limit) if acc[name]["ok"] else None
                if plan is None:
                    acc[name]["ok"] = False
                    continue
                result = analyse(plan, lengths, cost)
                acc[name]["critical"] += result["critical"]
                acc[name]["gpu_comm"] += result["gpu_comm"]
                acc[name]["gpu_busy"] += result["gpu_busy"]
                if b == 0:
                    for m, mb in enumerate(plan.micro_batches):
                        times = [cost.group_time(lengths[list(g.seq_ids)], g.degree) for g in mb.groups]
                        table3.append({"strategy": name, "micro_batch": m + 1, "groups": degrees_text(mb),
                                       "time_s": round(max(times), 3)})
    rows = []
    for name, a in acc.items():
        if not a["ok"]:
            rows.append({"strategy": name, "step_time_s": "infeasible"})
            continue
        c, comm, o = a["critical"]
        rows.append({"strategy": name, "step_time_s": round((c + comm + o) / args.batches, 3),
                     "critical_compute_s": round(c / args.batches, 3), "critical_a2a_s": round(comm / args.batches, 3),
                     "critical_overhead_s": round(o / args.batches, 3),
                     "a2a_share_critical": round(comm / (c + comm + o), 4),
                     "a2a_share_gpu_time": round(a["gpu_comm"] / a["gpu_busy"], 4),
                     "paper_a2a_share": paper.get(name, "n/a")})
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out / f"{args.stem}.csv", rows, COLUMNS)
    common.write_csv(args.out / f"{args.stem}_groups.csv", table3, TABLE3_COLUMNS)
    plot(rows, args.out / f"{args.stem}.png", args.batches)
    shown = [{"strategy": r["strategy"], "mean step (s)": r["step_time_s"],
              "compute / a2a / overhead on the critical path (s)":
                  f"{r.get('critical_compute_s', '')} / {r.get('critical_a2a_s', '')} / {r.get('critical_overhead_s', '')}",
              "a2a share, critical path": common.fmt(100 * r["a2a_share_critical"], 1, "%") if "a2a_share_critical" in r else "n/a",
              "a2a share, GPU time": common.fmt(100 * r["a2a_share_gpu_time"], 1, "%") if "a2a_share_gpu_time" in r else "n/a",
              "paper": r.get("paper_a2a_share", "")} for r in rows]
    body = (f"{MODEL}, {common.label(dist)}, {CONTEXT // 1024}K context, {NUM_GPUS} GPUs, batch {args.batch_size}.\n\n"
            f"**SP groups per micro-batch (first batch; `DxK` = K groups of degree D)**\n\n"
            + common.markdown_table(table3, TABLE3_COLUMNS)
            + f"\n\n**All-to-all share of the step ({args.batches} batches)**: critical path = sum over micro-batches "
            "of the slowest group's all-to-all time / step time; GPU time = all-to-all GPU-seconds of all groups / "
            "busy GPU-seconds.\n\n" + common.markdown_table(shown, list(shown[0]))
            + "\n\nLength distribution:\n" + common.provenance([DATASET]))
    common.write_markdown(args.out / f"{args.stem}.md", "Case study (paper Table 3, Fig. 5)", body, started, args.quick)
    print((args.out / f"{args.stem}.md").read_text())


def plot(rows: list[dict], path, batches: int) -> None:
    plt = common.pyplot()
    ok = [r for r in rows if r.get("a2a_share_critical") not in (None, "")]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    names = [r["strategy"].replace(" (", "\n(") for r in ok]
    bottom = np.zeros(len(ok))
    for key, label_, color in (("critical_compute_s", "compute", "#2ca02c"), ("critical_a2a_s", "all-to-all", "#d62728"),
                               ("critical_overhead_s", "fixed overhead (beta1)", "#7f7f7f")):
        values = np.array([r[key] for r in ok], dtype=float)
        ax.bar(names, values, bottom=bottom, label=label_, color=color)
        bottom += values
    for i, r in enumerate(ok):
        ax.text(i, bottom[i], f"a2a {100 * r['a2a_share_critical']:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"mean step time (s), critical path")
    ax.set_title(f"{MODEL}, {DATASET} (approx.), {CONTEXT // 1024}K, {NUM_GPUS} GPUs: where the step goes "
                 f"({batches} batches)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    common.save_figure(fig, Path(path), Path(path).with_suffix(".csv"))


if __name__ == "__main__":
    main()
