"""Planning at cluster scale (issue 10): N = 64 .. 16,384 GPUs, batches of 8 x N, 2M context.

Cost model: analytic, a LLaMA-7B-shaped model (32 heads, so degrees above 32 are Ulysses x ring
hybrids) on H100-80GB nodes of 8 with one 400 Gb/s NIC per GPU, ZeRO-3. Two length mixes:

* ``wikipedia``: the bundled lengths (sequences above the context are not drawn);
* ``long-mix``: Wikipedia plus long sequences, log-uniform in [256K, 2M] (capped at 90% of what the
  cluster can hold), enough of them to carry about a third of the batch's tokens.

Prints median / max solve time of FlexSP, plan / lower bound, and FlexSP's speedup over batchada,
static (largest degree) and dynamic-cp; then, at one size, communicators per rank against plan time
for restricted degree sets. ``--quick`` runs N = 64 and 256 only.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.analytic import analytic_cost_model
from flexsp.bounds import lower_bound
from flexsp.lengths import get_distribution, preprocess

CONTEXT = 2 * 1024 * 1024


def draw(mix: str, size: int, cost: flexsp.CostModel, cluster: flexsp.Cluster, rng: np.random.Generator) -> np.ndarray:
    wiki = get_distribution("wikipedia").lengths
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


def row(mix: str, num_gpus: int, reps: int, time_limit: float) -> str:
    cluster = flexsp.Cluster(num_gpus, 8)
    cost = analytic_cost_model("llama-7b", "h100-80gb", num_gpus=num_gpus)
    rng = np.random.default_rng(num_gpus)
    solve, ratio, speed = [], [], {"batchada": [], "static": [], "dynamic-cp": []}
    for _ in range(reps):
        lengths = draw(mix, 8 * num_gpus, cost, cluster, rng)
        plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=time_limit)
        solve.append(plan.solve_time)
        ratio.append(plan.predicted_time / lower_bound(lengths, cost, cluster))
        for name in speed:
            other = flexsp.plan_batch(lengths, cost, cluster, name, time_limit=time_limit)
            speed[name].append(other.predicted_time / plan.predicted_time)
    return (f"| {mix} | {num_gpus} | {8 * num_gpus} | {np.median(solve):.2f} / {np.max(solve):.2f} | "
            f"{np.mean(ratio):.3f} | " + " | ".join(f"{np.mean(v):.2f}x" for v in speed.values()) + " |")


def restrictions(num_gpus: int, reps: int, time_limit: float) -> str:
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
        times = [flexsp.plan_batch(x, cost, cluster, "flexsp", degrees=degrees, time_limit=time_limit).predicted_time
                 for x in batches]
        base = base or times
        used = cluster.degrees if degrees is None else degrees
        lines.append(f"| {'all' if degrees is None else ','.join(map(str, degrees))} | {sum(d > 1 for d in used)} | "
                     f"{np.mean(np.array(times) / np.array(base)):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale_benchmark.md")
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else [64, 256, 1024, 4096, 16384]
    reps = 1 if args.quick else args.reps
    started = time.time()
    lines = ["### FlexSP at scale: analytic LLaMA-7B on H100 (32 heads: degrees above 32 are Ulysses x ring), "
             "context 2M, batch 8 x N", "",
             "| lengths | GPUs | batch | solve median / max (s) | plan / lower bound | vs batchada | vs static | vs dynamic-cp |",
             "|---|---|---|---|---|---|---|---|"]
    for mix, n in tqdm([(m, n) for m in ("wikipedia", "long-mix") for n in sizes], desc="scale"):
        lines.append(row(mix, n, reps, args.time_limit))
    text = "\n".join(lines) + "\n\n" + restrictions(256 if args.quick else 4096, reps, args.time_limit)
    text += f"\n\n(measured on this 2-core machine in {time.time() - started:.0f} s)\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
