"""Soak (issue 18): hundreds of steps on 4 gloo ranks with background planning and checkpoints, watching
for leaks. Measured on this machine's CPU (gloo); nothing here is a GPU figure.

Each rank trains a tiny fp64 LM with ``FlexSPLoader`` (lookahead 2: plans solved in a thread ahead of
the loop), the ``StepExecutor`` and a ``Checkpointer`` (every 50 steps, 10 in quick mode; keep 2), epoch after epoch, and
records its resident memory (VmRSS), live process groups (the pool's communicators plus the side
groups of loader and checkpointer) and Python threads after every step. Pass criteria, after a
warm-up of the first 20% of steps:

- RSS: the largest value after warm-up exceeds the value at the end of warm-up by at most
  ``RSS_BOUND_MIB`` (16 MiB) on every rank;
- communicators: the same count at every step after warm-up;
- at exit: no Python thread but the main one on any rank, every rank process exited with code 0, and
  no child process of the launcher left alive.

    python experiments/soak.py            # 300 steps, writes results/soak.{json,md}
    python experiments/soak.py --quick    # CI: 30 steps, writes into --out
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from launch import free_port  # noqa: E402
from outputs import resolve_out  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORLD, RSS_BOUND_MIB, WARMUP_FRACTION = 4, 16.0, 0.2


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _communicators() -> int:
    """Live process groups in this process (c10d's registry), the default group included."""
    import torch.distributed.distributed_c10d as c10d
    return len(c10d._world.pg_map)


def _rank(rank: int, port: int, steps: int, every: int, directory: str, queue) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import flexsp
    from flexsp import PlanConfig
    from flexsp.checkpoint import Checkpointer
    from flexsp.data import FlexSPLoader, LoaderConfig
    from flexsp.plan.specs import ModelSpec
    from flexsp.runtime import GroupPool, StepExecutor, TinyLM, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        rng = np.random.default_rng(0)
        data = [[(3 * i + t) % 97 for t in range(int(n))] for i, n in
                enumerate(np.clip(rng.lognormal(3.0, 0.8, 64).astype(int) + 2, 2, 160))]
        cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=1024,
                                alltoall_bandwidth={2: 1e9, 4: 5e8}, token_capacity=64)
        torch.manual_seed(0)
        model = TinyLM(ModelSpec(vocab=97, hidden=16, layers=1, heads=4, kv_heads=2,
                                   ffn=32, tie_embeddings=True)).double()
        pool = GroupPool()
        shard_model(model, param_dtype=None)   # FSDP2-sharded states, as the cost model's capacity assumes
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        executor = StepExecutor(model, opt, pool, cost=cost, backend="sdpa")
        config = LoaderConfig(batch_size=8, seed=1, lookahead=2, failure_timeout=60, plan=PlanConfig(strategy="flexsp", time_limit=0.05))
        trace = []
        started = time.perf_counter()
        loader = FlexSPLoader(data, cost, flexsp.Cluster(WORLD, WORLD), config, pool=pool)
        ckpt = Checkpointer(directory, model, opt, loader=loader, every=every, keep=2, timeout=60)
        with loader, ckpt, executor:
            while ckpt.step < steps:
                for step in loader:
                    executor.step(step)
                    ckpt.step_done()
                    trace.append((_rss_mib(), _communicators(), threading.active_count()))
                    if ckpt.step >= steps:
                        break
        dist.barrier()
        leftover = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        queue.put((rank, {"trace": trace, "threads_at_exit": leftover, "pool": repr(pool),
                          "loop_seconds": time.perf_counter() - started}))
    finally:
        dist.destroy_process_group()


def run(steps: int, every: int, timeout: float) -> dict:
    ctx = mp.get_context("forkserver")   # ranks fork from one process that imported torch once
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "flexsp.runtime", "flexsp.data",
                                "flexsp.checkpoint.checkpointer"])
    queue = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        procs = [ctx.Process(target=_rank, args=(r, port, steps, every, directory, queue)) for r in range(WORLD)]
        started = time.perf_counter()
        for p in procs:
            p.start()
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < WORLD and time.monotonic() < deadline:
            try:
                rank, value = queue.get(timeout=1.0)
                results[rank] = value
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        seconds = time.perf_counter() - started
    if len(results) < WORLD or hung:
        raise SystemExit(f"soak failed: ranks reported {sorted(results)}, still running after {timeout:.0f}s: {hung}, "
                         f"exit codes {[p.exitcode for p in procs]}")
    return {"steps": steps, "seconds": seconds, "exitcodes": [p.exitcode for p in procs],
            "children_left": [c.pid for c in mp.active_children()], "ranks": [results[r] for r in range(WORLD)]}


def _slope(values: list[float]) -> float:
    """Least-squares slope per step (0 for fewer than two points)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def summarise(raw: dict) -> dict:
    warm = max(1, int(raw["steps"] * WARMUP_FRACTION))
    ranks = []
    for r, out in enumerate(raw["ranks"]):
        rss = [t[0] for t in out["trace"]]
        comms = [t[1] for t in out["trace"]]
        threads = [t[2] for t in out["trace"]]
        after = rss[warm:]
        half = len(after) // 2
        slope = _slope(after) * 100
        ranks.append({"rank": r, "rss_slope_mib_per_100_steps": slope,
                      "rss_growth_second_half_mib": max(after[half:]) - after[half] if half else 0.0,
                      "rss_start_mib": rss[0], "rss_warm_mib": rss[warm - 1], "rss_max_after_warm_mib":
                      max(rss[warm:]), "rss_end_mib": rss[-1], "rss_growth_mib": max(rss[warm:]) - rss[warm - 1],
                      "communicators": sorted(set(comms[warm:])), "max_threads": max(threads),
                      "threads_at_exit": out["threads_at_exit"]})
    ok = {
        "rss_flat": all(r["rss_growth_mib"] <= RSS_BOUND_MIB for r in ranks),
        "communicators_flat": all(len(r["communicators"]) == 1 for r in ranks),
        "no_threads_left": all(not r["threads_at_exit"] for r in ranks),
        "processes_exited": raw["exitcodes"] == [0] * WORLD and not raw["children_left"],
    }
    return {"steps": raw["steps"], "warmup_steps": warm, "seconds": raw["seconds"],
            "loop_seconds": max(out["loop_seconds"] for out in raw["ranks"]), "rss_bound_mib": RSS_BOUND_MIB,
            "ranks": ranks, "pass": ok, "passed": all(ok.values())}


def markdown(summary: dict, quick: bool) -> str:
    lines = [f"# Soak: {summary['steps']} steps on {WORLD} gloo ranks{' (quick mode)' if quick else ''}", "",
             "Measured on a shared 2-core CPU machine, gloo; background planning (lookahead 2), checkpoints every "
             f"{summary['checkpoint_every']} steps. Warm-up: first {summary['warmup_steps']} steps. Bound: RSS growth after warm-up "
             f"<= {summary['rss_bound_mib']:g} MiB, communicator count constant.", "",
             "| rank | RSS start MiB | RSS after warm-up | max after warm-up | end | growth MiB | slope MiB/100 steps "
             "| growth in 2nd half MiB | communicators | max threads | threads left at exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["ranks"]:
        lines.append(f"| {r['rank']} | {r['rss_start_mib']:.1f} | {r['rss_warm_mib']:.1f} | "
                     f"{r['rss_max_after_warm_mib']:.1f} | {r['rss_end_mib']:.1f} | {r['rss_growth_mib']:.2f} | "
                     f"{r['rss_slope_mib_per_100_steps']:.2f} | {r['rss_growth_second_half_mib']:.2f} | "
                     f"{r['communicators']} | {r['max_threads']} | {len(r['threads_at_exit'])} |")
    lines += ["", f"Wall time {summary['seconds']:.1f} s ({summary['loop_seconds']:.1f} s in the training loop). "
              "Checks: " +
              ", ".join(f"{k} {'PASS' if v else 'MISSED'}" for k, v in summary["pass"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 steps (CI)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the run counts as hung")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: results/; a temporary folder with --quick)")
    args = parser.parse_args(argv)
    args.out = resolve_out(args.out, args.quick, RESULTS)
    steps = args.steps or (30 if args.quick else 300)
    every = 10 if args.quick else 50
    summary = summarise(run(steps, every, args.timeout or (120 if args.quick else 1800)))
    summary["checkpoint_every"] = every
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary, args.quick)
    (args.out / "soak.md").write_text(text)
    print(text)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
