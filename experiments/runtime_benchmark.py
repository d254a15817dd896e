"""Runtime benchmark (issue 13): step time and peak memory per rank on 4 gloo ranks (CPU), for the
FlexSP plan and a static-degree plan of the same global batch, with FSDP2 full sharding and without.

Measured on the CPU with gloo: a CPU figure, not a GPU one (attention is torch SDPA on CPU, the
all-to-all goes through loopback TCP). The configurations run one after another in the same 4
processes, after one unreported warm-up configuration; before each, the previous model is freed and returned to the OS (``malloc_trim``) and the
resident set's high-water mark is reset (``/proc/self/clear_refs``), so:

* step time: the median over the timed steps of the slowest rank's ``StepResult.seconds``;
* peak memory: growth of the high-water mark (``VmHWM``) over the resident set at the start of the
  configuration (includes allocator caching and the unsharded copies FSDP all-gathers), and the
  exact bytes of parameters + gradients + optimizer states the rank holds after a step.

    python experiments/runtime_benchmark.py           # 256-wide 4-layer model, ~6K-token batch, 3 timed steps
    python experiments/runtime_benchmark.py --quick   # CI: tiny model, 1 timed step
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from statistics import median

import numpy as np

import flexsp
from flexsp.plan.planner import plan_batch
from flexsp.plan.specs import ModelSpec
from outputs import resolve_out  # noqa: E402
from launch import run_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4
LABEL = "measured on CPU: 4 gloo processes on one machine, torch SDPA attention; not a GPU figure"


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def _free() -> None:
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)   # hand freed heap pages back so the next peak is its own
    except OSError:
        pass


def _measure(cfg: dict, plan: flexsp.Plan, tokens: list, sharding: str, steps: int, pool, name: str) -> dict:
    import torch

    from flexsp.runtime import StepExecutor, TinyLM, shard_model

    _free()
    _reset_peak()
    base = _rss_kib("VmRSS")
    torch.manual_seed(0)
    model = TinyLM(ModelSpec(**cfg))
    shard_model(model, sharding=sharding, param_dtype=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    executor = StepExecutor(model, optimizer, pool, backend="sdpa", failure_name=name)
    executor.run_plan(plan, tokens)   # warm-up: optimizer states exist from here on
    seconds = [executor.run_plan(plan, tokens).seconds for _ in range(steps)]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t   # noqa: E731
    params = list(model.parameters())
    state = sum(local(p).numel() * p.element_size() for p in params)
    state += sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    state += sum(local(v).numel() * v.element_size() for p in params for k, v in optimizer.state[p].items()
                 if k != "step")
    return {"seconds": seconds, "peak_mib": (_rss_kib("VmHWM") - base) / 1024, "state_mib": state / 2**20}


def _worker(rank: int, port: int, cfg: dict, configs: list, batch: list, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from flexsp.runtime import GroupPool

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=300))
        pool = GroupPool()
        tokens = [torch.tensor(seq) for seq in batch]
        plan, sharding = configs[0]   # unreported warm-up: one-time costs (lazy init, gloo buffers, imports)
        _measure(cfg, flexsp.Plan.from_dict(plan), tokens, sharding, 1, pool, "bench-warm-up")
        results = [_measure(cfg, flexsp.Plan.from_dict(plan), tokens, sharding, steps, pool, f"bench-{i}")
                   for i, (plan, sharding) in enumerate(configs)]
        out.put((rank, results))
        dist.destroy_process_group()
    except BaseException as exc:   # report instead of hanging the parent
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_configs(cfg: dict, configs: list, batch: list, steps: int, timeout: float) -> list[list[dict]]:
    """Per configuration, per rank: the measurements (4 processes, all configurations in turn)."""
    results = run_ranks(_worker, WORLD, (cfg, configs, batch, steps), timeout)
    errors = {r: v["error"] for r, v in results.items() if isinstance(v, dict)}
    if errors or len(results) < WORLD:
        raise SystemExit(f"ranks failed or timed out: {errors or sorted(set(range(WORLD)) - set(results))}")
    return [[results[r][i] for r in range(WORLD)] for i in range(len(configs))]


def describe(plan: flexsp.Plan) -> str:
    return " ".join("[" + " ".join(str(g.degree) for g in mb.groups) + "]" for mb in plan.micro_batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: tiny model and batch, one timed step")
    parser.add_argument("--out", type=Path, default=None, help="Markdown report (default: results/; a temporary file with --quick)")
    args = parser.parse_args()
    args.out = resolve_out(args.out, args.quick, RESULTS / "runtime_benchmark.md")
    if args.quick:
        cfg = dict(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)
        num_seqs, max_len, capacity, steps = 12, 200, 64, 1
    else:
        cfg = dict(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=4, ffn=768, tie_embeddings=True)
        num_seqs, max_len, capacity, steps = 48, 1600, 512, 3
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(4.5, 1.0, num_seqs).astype(int) + 8, max_len)
    lengths[0] = max_len   # one long sequence: it needs a group of all 4 ranks
    batch = [(np.arange(n) * 7 + i) % cfg["vocab"] for i, n in enumerate(lengths)]
    batch = [b.tolist() for b in batch]
    cluster = flexsp.Cluster(num_gpus=WORLD, gpus_per_node=WORLD)
    # Made-up coefficients with a slow degree-4 all-to-all, so short sequences prefer small groups.
    cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=2048,
                            alltoall_bandwidth={2: 2e9, 4: 2e8}, token_capacity=capacity, heads=cfg["heads"],
                            kv_heads=cfg["kv_heads"], meta={"sharding": "none"})
    plans = {"flexsp": plan_batch(lengths, cost, cluster, strategy="flexsp", time_limit=2.0, ulysses_only=True),
             "static (degree 4)": plan_batch(lengths, cost, cluster, strategy="static", sp_degree=4)}

    configs = [(name, sharding) for name in plans for sharding in ("full", "none")]
    measured = run_configs(cfg, [(plans[n].to_dict(), sh) for n, sh in configs], batch, steps,
                           timeout=300 if args.quick else 1200)
    rows = []
    for (name, sharding), ranks in zip(configs, measured):
        step = median(max(r["seconds"][i] for r in ranks) for i in range(steps))
        rows.append((name, sharding, describe(plans[name]), step, [r["peak_mib"] for r in ranks],
                     [r["state_mib"] for r in ranks]))
        print(f"{name:18s} sharding={sharding:5s} step {step:.3f}s  peak MiB/rank "
              f"{' '.join(f'{m:.1f}' for m in rows[-1][4])}  states MiB/rank "
              f"{' '.join(f'{m:.2f}' for m in rows[-1][5])}", flush=True)

    lines = [f"# Runtime benchmark ({'quick' if args.quick else 'full'})", "", f"**{LABEL}.** Load on the "
             f"machine at the time: {os.getloadavg()[0]:.1f} (1-minute load average); timings are noisy.", "",
             f"Model: TinyLM {cfg}; batch: {num_seqs} sequences, {int(lengths.sum())} tokens (longest {int(lengths.max())}); "
             f"{steps} timed step(s) after one warm-up; fp32 compute, AdamW. `full` = FSDP2 full shard, `none` = "
             f"FSDP2 over a (4 x 1) mesh (replicated states, data parallel).", "",
             "| plan | sharding | groups per micro-batch | step s (slowest rank, median) | peak RSS growth MiB per rank | "
             "params+grads+optimizer MiB per rank |", "|---|---|---|---|---|---|"]
    for name, sharding, groups, step, peak, state in rows:
        lines.append(f"| {name} | {sharding} | {groups} | {step:.3f} | {' / '.join(f'{m:.1f}' for m in peak)} | "
                     f"{' / '.join(f'{m:.3f}' for m in state)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
