"""FlexSP against Megatron-Core's dynamic context-parallel rule (issue 9), in one simulator.

Every strategy plans the same global batches of bundled Wikipedia lengths and is scored by the same
cost model (the paper's A100 presets): gpt-7b at 384K context and gpt-13b at 192K, both on 64 GPUs
(8 x 8), global batch 512. Prints and writes as Markdown the mean simulated step time per strategy,
the mean number of micro-batches, and the mean per-batch speedup of FlexSP over dynamic-cp.

    python experiments/dynamic_cp_benchmark.py                # full: 10 batches of 512 per setting
    python experiments/dynamic_cp_benchmark.py --quick        # CI: 2 batches of 64
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

import flexsp
from flexsp.lengths import get_distribution, preprocess

NUM_GPUS, GPUS_PER_NODE = 64, 8
SETTINGS = (("gpt-7b", 384 * 1024), ("gpt-13b", 192 * 1024))
STRATEGIES = {"FlexSP": ("flexsp", None), "dynamic-cp": ("dynamic-cp", None), "batchada": ("batchada", None),
              "static(64)": ("static", 64)}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dynamic_cp.md"


@dataclass
class SettingResult:
    model: str
    context: int
    step_time: dict[str, list[float]]
    micro_batches: dict[str, list[int]]
    dropped: int
    sequences: int

    def mean(self, name: str) -> float:
        return float(np.mean(self.step_time[name]))

    def speedup(self, name: str, over: str) -> float:
        """Mean over batches of ``over``'s step time divided by ``name``'s (> 1: ``name`` is faster)."""
        return float(np.mean(np.asarray(self.step_time[over]) / np.asarray(self.step_time[name])))


def run_setting(model: str, context: int, num_batches: int, batch_size: int, seed: int, time_limit: float,
                progress: bool) -> SettingResult:
    cost = flexsp.CostModel.from_preset(model, context=context, num_gpus=NUM_GPUS)
    cluster = flexsp.Cluster(NUM_GPUS, GPUS_PER_NODE)
    dist = get_distribution("wikipedia")
    result = SettingResult(model, context, {n: [] for n in STRATEGIES}, {n: [] for n in STRATEGIES}, 0, 0)
    bar = tqdm(range(num_batches), desc=f"{model} {context // 1024}K", disable=not progress)
    for b in bar:
        lengths, dropped = preprocess(dist.sample_batch(batch_size, seed + b), context, NUM_GPUS)
        result.dropped += dropped
        result.sequences += len(lengths)
        for name, (strategy, degree) in STRATEGIES.items():
            plan = flexsp.plan_batch(lengths, cost, cluster, strategy, sp_degree=degree, time_limit=time_limit)
            result.step_time[name].append(plan.predicted_time)
            result.micro_batches[name].append(len(plan.micro_batches))
    return result


def table(results: list[SettingResult]) -> str:
    names = list(STRATEGIES)
    lines = ["| setting | " + " | ".join(f"{n} (s)" for n in names) + " | FlexSP speedup over dynamic-cp |",
             "|---" * (len(names) + 2) + "|"]
    for r in results:
        cells = [f"{r.mean(n):.2f}" for n in names]
        lines.append(f"| {r.model} {r.context // 1024}K | " + " | ".join(cells)
                     + f" | {r.speedup('FlexSP', 'dynamic-cp'):.3f}x |")
    lines += ["", "Mean micro-batches per step:", "",
              "| setting | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in results:
        lines.append(f"| {r.model} {r.context // 1024}K | "
                     + " | ".join(f"{np.mean(r.micro_batches[n]):.1f}" for n in names) + " |")
    return "\n".join(lines)


def report(results: list[SettingResult], args: argparse.Namespace) -> str:
    batches = args.batches
    kept = sum(r.sequences for r in results)
    dropped = sum(r.dropped for r in results)
    return "\n".join([
        "# FlexSP vs Megatron-Core dynamic context parallelism (simulated)",
        "",
        f"Bundled Wikipedia lengths, {NUM_GPUS} GPUs ({NUM_GPUS // GPUS_PER_NODE} x {GPUS_PER_NODE}), the paper's "
        f"A100 cost-model presets, global batch {args.batch_size}, {batches} batches per setting (seeds "
        f"{args.seed}..{args.seed + batches - 1}), FlexSP time limit {args.time_limit:g} s. Lengths above the context "
        f"limit are dropped ({dropped} of {kept + dropped} sampled), the rest padded to a multiple of 2 x N. "
        "Step time = the cost model's prediction for the plan (sum over micro-batches of the slowest group). "
        "Speedup = mean over batches of dynamic-cp time / FlexSP time.",
        "",
        table(results),
        "",
        "Reproduce: `python experiments/dynamic_cp_benchmark.py"
        + (" --quick" if args.quick else f" --batches {batches} --batch-size {args.batch_size}") + "`",
        "",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=10, help="global batches per setting")
    p.add_argument("--batch-size", type=int, default=512, help="sequences sampled per global batch")
    p.add_argument("--quick", action="store_true", help="CI mode: 2 batches of 64")
    p.add_argument("--seed", type=int, default=0, help="seed of the first batch (batch i uses seed + i)")
    p.add_argument("--time-limit", type=float, default=2.0, help="FlexSP search time limit per batch (s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown output file")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm bar")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.batch_size = 2, 64
    if args.batches < 1 or args.batch_size < 1:
        p.error("--batches and --batch-size must be >= 1")
    results = [run_setting(model, context, args.batches, args.batch_size, args.seed, args.time_limit,
                           not args.no_progress) for model, context in SETTINGS]
    text = report(results, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
