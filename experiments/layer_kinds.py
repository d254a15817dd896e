"""Layer kinds in the plan: models with windowed, linear-attention and MoE layers against the same model
costed as if every layer were full causal attention (what the planner assumed before layer kinds).

For each analytic preset (``flexsp.plan.presets.ANALYTIC_PRESETS``: GPT-OSS-20B, Gemma-3-27B, Qwen3.5-27B on
H100-80GB, datasheet FLOP/s and bandwidths) and its all-full-attention twin (same shapes and experts, every
mixer full attention), plan Wikipedia batches with FlexSP and report the token capacity, the SP degrees
used, the predicted step time, and the step time the twin's plans take on the real model: a plan tuned
for the wrong model, scored by the right one (``OOM`` where the twin's plan holds more tokens per GPU than
the real model's capacity).

    python experiments/layer_kinds.py            # 5 batches of 512 on 64 GPUs
    python experiments/layer_kinds.py --quick    # 1 batch of 128
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np

import flexsp
from flexsp.plan.analytic import cost_from_hardware
from flexsp.plan.presets import ANALYTIC_PRESETS
from flexsp.plan.specs import get_model

try:
    from . import common
except ImportError:  # run as a script
    import common

DATASET, CONTEXT, NUM_GPUS = "wikipedia", 384 * 1024, 64
COLUMNS = ["model", "costed_as", "layers", "token_capacity", "largest_group", "left_out", "mean_step_s",
           "degrees_used", "twin_plan_on_model_s", "twin_plan_slowdown"]
LABEL = ("**Simulated, not measured**: times are predicted by analytic cost models (`flexsp.cost_from_hardware`: "
         "H100-80GB datasheet FLOP/s at 50% efficiency and assumed bandwidths, `flexsp.plan.analytic`), one per "
         "model and per twin; nobody has measured these models with FlexSP.")


def full_twin(spec):
    """``spec`` with every layer full causal attention (experts, widths and sinks kept)."""
    kinds = tuple((dataclasses.replace(k, mixer="full", size=0), n) for k, n in spec.kinds)
    return dataclasses.replace(spec, kinds=kinds, linear=None, name=spec.name + " (all full)")


def _mixers(spec) -> str:
    counts: Counter = Counter()
    for k, n in spec.kind_counts().items():
        counts[k.mixer + (f" {k.size}" if k.size else "")] += n
    return ", ".join(f"{n} {m}" for m, n in counts.items())


def degrees_used(plans) -> str:
    counts = Counter(g.degree for p in plans for mb in p.micro_batches for g in mb.groups)
    return " ".join(f"{d}x{counts[d]}" for d in sorted(counts))


def runs_on(plan: flexsp.Plan, lengths: np.ndarray, cost: flexsp.CostModel) -> str | None:
    """Why ``plan`` cannot run on the model of ``cost`` (a group past its memory, or a degree it cannot run:
    a ring for linear-attention layers), or None."""
    for mb in plan.micro_batches:
        for g in mb.groups:
            if not cost.costs_degree(g.degree):
                return "needs a ring"
            if not cost.fits(lengths[list(g.seq_ids)], g.degree):
                return "OOM"
    return None


def largest_group(cost: flexsp.CostModel, cluster: flexsp.Cluster) -> int:
    """The widest group the model runs on ``cluster`` (a model without a ring axis: its Ulysses limit)."""
    return max(d for d in cluster.degrees if d == 1 or cost.costs_degree(d))


def main() -> None:
    p = common.parser(__doc__, "layer_kinds")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--time-limit", type=float, default=30.0,
                   help="seconds per solve: high, so that machine load never cuts a search (default 30)")
    args = common.parse(p)
    if args.quick:
        args.batches, args.batch_size, args.time_limit = 1, 128, 0.5
    started = time.time()
    cluster = flexsp.Cluster(num_gpus=NUM_GPUS, gpus_per_node=8)
    dist = common.distribution(DATASET)
    batches = list(common.batches(dist, args.batches, args.batch_size, CONTEXT, NUM_GPUS, args.seed))
    rows = []
    for name, gpu in ANALYTIC_PRESETS.items():
        spec = get_model(name)
        twin = full_twin(spec)
        cost = cost_from_hardware(spec, gpu, NUM_GPUS)
        twin_cost = cost_from_hardware(twin, gpu, NUM_GPUS)
        # both plan the sequences the real model can hold: a model without a ring axis (linear attention) holds
        # at most its Ulysses limit's GPUs' worth (Qwen3.5-27B: 8 GPUs); the rest are counted, not planned
        widest = largest_group(cost, cluster)
        held_batches = [b[b <= cost.group_capacity(widest)] for b in batches]
        left_out = sum(len(b) - len(h) for b, h in zip(batches, held_batches))
        own = [flexsp.plan_batch(b, cost, cluster, time_limit=args.time_limit) for b in held_batches]
        twins = [flexsp.plan_batch(b, twin_cost, cluster, time_limit=args.time_limit) for b in held_batches]
        own_time = float(np.mean([pl.predicted_time for pl in own]))
        why = next((w for pl, b in zip(twins, held_batches) if (w := runs_on(pl, b, cost))), None)
        twin_on_model = float(np.mean([pl.time(b, cost) for pl, b in zip(twins, held_batches)])) if why is None else None
        rows.append({"model": name, "costed_as": "its layer kinds", "layers": _mixers(spec),
                     "token_capacity": int(cost.token_capacity), "largest_group": widest, "left_out": left_out,
                     "mean_step_s": common.fmt(own_time, 3),
                     "degrees_used": degrees_used(own), "twin_plan_on_model_s": "",
                     "twin_plan_slowdown": ""})
        rows.append({"model": name, "costed_as": "every layer full attention", "layers": _mixers(twin),
                     "token_capacity": int(twin_cost.token_capacity),
                     "largest_group": largest_group(twin_cost, cluster), "left_out": left_out,
                     "mean_step_s": common.fmt(float(np.mean([pl.predicted_time for pl in twins])), 3),
                     "degrees_used": degrees_used(twins),
                     "twin_plan_on_model_s": common.fmt(twin_on_model, 3) if why is None else why,
                     "twin_plan_slowdown": common.fmt(twin_on_model / own_time, 3, "x") if why is None else why})
    common.write_csv(args.out / f"{args.stem}.csv", rows, COLUMNS)
    body = (f"{args.batches} {common.label(dist)} batches of {args.batch_size} sequences, {NUM_GPUS} GPUs (8 per node), context "
            f"{CONTEXT:,}; FlexSP plans (time limit {args.time_limit:g} s). `largest_group`: the widest SP group the "
            f"model runs on (a model with linear-attention layers has no ring axis, so its Ulysses limit: the heads "
            f"every layer splits by); `left_out`: sequences longer than that group holds, over all batches, left out "
            f"of both plans. `twin_plan_on_model_s`: the all-full-"
            f"attention twin's plans timed by the real model's cost (`OOM`: a twin plan puts more tokens on a GPU "
            f"than the real model holds; `needs a ring`: it uses a group wider than the real model can run); "
            f"`twin_plan_slowdown`: that over the real model's own plans. The activation bytes "
            f"of MoE and Gemma layers are fitted to what transformers' layers save (within 1% on CPU); those of "
            f"linear-attention layers are counts of what they are built to save, not yet measured "
            f"(`flexsp.plan.memory.layer_activation_bytes`).\n\n"
            + common.markdown_table(rows, COLUMNS) + "\n\n" + common.provenance([DATASET]))
    common.write_markdown(args.out / f"{args.stem}.md", "Layer kinds: how plans differ from an all-full-attention "
                          "model", body, started, args.quick, label=LABEL)
    if not args.no_progress:
        print((args.out / f"{args.stem}.md").read_text())


if __name__ == "__main__":
    main()
