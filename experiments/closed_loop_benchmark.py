"""Closed-loop benchmark (issue 29): a run that starts from a wrong cost model (alpha1 x10), with and
without the online refit, and the cost of recording every step.

1. **Simulated refit** (label SIM): the "true" machine is the paper's gpt-7b constants on 8 GPUs;
   measured group times are its times + 2% noise with 5% outliers (x3). Per step: the median
   |predicted - measured| / measured over the step's groups, and the step's true time (the plan
   run on the true machine), with and without the refit. Target: error below 5% within 3 steps.
2. **Measured refit** (label CPU): 4 gloo processes train a TinyLM through ``FlexSPLoader`` on this
   CPU, starting from made-up coefficients with alpha1 x10; the same per-step figures, measured.
3. **Measurement overhead** (label CPU): the same fixed plan stepped in alternating blocks with the
   recorder on and off (``StepExecutor.probe``); the median step time of each, and the time the
   recorder's hooks spend on the training thread (measured by the recorder itself). Target: <= 1%.
   Measured twice: on the 4 gloo ranks above, and in a world of one at ``examples/train.py``'s model
   shape (the run whose GPU figure the issue quotes), where the telemetry thread's CPU time per step is
   also what it can take from the training thread's interpreter.

    python experiments/closed_loop_benchmark.py           # writes experiments/results/closed_loop_benchmark.md
    python experiments/closed_loop_benchmark.py --quick   # CI: small, writes to a temporary folder (or --out)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from statistics import median

import numpy as np

import flexsp
from flexsp.plan.specs import ModelSpec
from flexsp.telemetry.records import group_errors, read_records
from flexsp.telemetry.refit import RefitConfig, Refitter
from launch import run_ranks  # noqa: E402
from outputs import resolve_out  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4
SIM = ("simulated: group times from the paper's gpt-7b constants on 8 GPUs (the 'true' machine) + 2% noise, "
       "5% outliers x3; planning starts from alpha1 x10")
CPU = "measured on CPU: 4 gloo processes on one shared machine, torch SDPA attention; not a GPU figure"
BOUND, WITHIN, OVERHEAD = 0.05, 3, 0.01


# --- 1. simulated -----------------------------------------------------------------------------------
def simulated(steps: int, strategy: str, seed: int = 0) -> dict[str, list[float]]:
    true = flexsp.cost_from_preset("gpt-7b", context=64 * 1024, num_gpus=8)
    wrong = dataclasses.replace(true, alpha1=true.alpha1 * 10)
    cluster = flexsp.Cluster(8, 8)
    out: dict[str, list[float]] = {}
    for refit in (False, True):
        rng, batches = np.random.default_rng(seed), np.random.default_rng(seed + 1)   # both runs: the same batches
        refitter, cost = Refitter(wrong), wrong
        errors, times = [], []
        for _ in range(steps):
            lengths = np.clip(batches.lognormal(8.5, 1.2, 32).astype(int), 128, 30000)
            plan = flexsp.plan_batch(lengths, cost, cluster, strategy=strategy, time_limit=0.5)
            step_errors, step_time = [], 0.0
            for mb in plan.micro_batches:
                slowest = 0.0
                for g in mb.groups:
                    glen = [int(lengths[s]) for s in g.seq_ids]
                    t = true.group_time(glen, g.degree)
                    slowest = max(slowest, t)
                    seen = t * (1 + 0.02 * rng.standard_normal()) * (3 if rng.random() < 0.05 else 1)
                    step_errors.append(abs(cost.group_time(glen, g.degree) - seen) / seen)
                    refitter.observe(g.degree, glen, seen)
                step_time += slowest
            errors.append(float(np.median(step_errors)))
            times.append(step_time)
            new = refitter.refit() if refit else None
            cost = new or cost
        key = "refit" if refit else "no refit"
        out[f"{key} error"], out[f"{key} time"] = errors, times
    return out


# --- 2 + 3. measured on 4 gloo ranks ------------------------------------------------------------------
def _worker(rank: int, port: int, cfg: dict, settings: dict, run_root: str, out) -> None:
    import torch
    import torch.distributed as dist

    from flexsp.data import FlexSPLoader, LoaderConfig
    from flexsp.runtime import GroupPool, StepExecutor, TinyLM, shard_model
    from flexsp.telemetry import Telemetry

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=600))
        pool = GroupPool()
        spec = ModelSpec(**cfg)
        cluster = flexsp.Cluster(WORLD, WORLD)
        made_up = flexsp.CostModel(alpha1=2e-8, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=4 * 2 * cfg["layers"] *
                                   cfg["hidden"] * 4, alltoall_bandwidth={2: 1e9, 4: 5e8},
                                   token_capacity=settings["capacity"], meta={"sharding": "full"})   # alpha1 x10
        rng = np.random.default_rng(0)
        lengths = np.minimum(rng.lognormal(4.8, 0.9, 400).astype(int) + 8, settings["capacity"] * WORLD)
        data = [((np.arange(n) * 7 + i) % cfg["vocab"]).tolist() for i, n in enumerate(lengths)]
        result = {}
        for refit in (False, True):
            torch.manual_seed(0)
            model = TinyLM(spec)
            shard_model(model, sharding="full", param_dtype=None)
            name = "refit" if refit else "no-refit"
            loader = FlexSPLoader(data, made_up, cluster, LoaderConfig(batch_size=settings["batch"], lookahead=1,
                                  plan=flexsp.PlanConfig(strategy="greedy")), pool=pool)
            telemetry = Telemetry(Path(run_root) / name, made_up, spec=spec, log_every=0,
                                  refit=RefitConfig(min_points=4) if refit else False, on_refit=loader.set_cost)
            executor = StepExecutor(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pool, cost=made_up,
                                    backend="sdpa", probe=telemetry.probe, failure_name=f"bench-{name}")
            done = 0
            while done < settings["steps"]:
                for step in loader:   # one epoch at a time
                    executor.step(step)
                    done += 1
                    if done == settings["steps"]:
                        break
            telemetry.close()
            executor.close()
            loader.close()

        result.update(_overhead(pool, spec, data[:settings["batch"]], made_up, cluster, settings["pairs"],
                                Path(run_root) / "overhead"))
        out.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:   # report instead of hanging the parent
        import traceback
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def _overhead(pool, spec: ModelSpec, data: list, cost: flexsp.CostModel, cluster: flexsp.Cluster, pairs: int,
              run_dir: Path) -> dict:
    """One fixed greedy plan of ``data`` stepped with the recorder on and off, alternating step by step in
    both orders: each step's seconds per mode, and the telemetry thread's CPU time in all."""
    import torch

    from flexsp.runtime import StepExecutor, TinyLM, shard_model
    from flexsp.runtime.probe import NO_PROBE
    from flexsp.telemetry import Telemetry

    torch.manual_seed(0)
    model = TinyLM(spec)
    shard_model(model, sharding="full", param_dtype=None)
    batch = [torch.tensor(d) for d in data]
    plan = flexsp.plan_batch([len(d) for d in data], cost, cluster, strategy="greedy")
    telemetry = Telemetry(run_dir, cost, spec=spec, log_every=0)
    executor = StepExecutor(model, torch.optim.AdamW(model.parameters(), lr=1e-3), pool, backend="sdpa",
                            failure_name=f"bench-overhead-{run_dir.name}")
    executor.run_plan(plan, batch)   # warm-up
    seconds = {"on": [], "off": []}
    for pair in range(pairs):
        for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
            executor.probe = telemetry.probe if mode == "on" else NO_PROBE
            seconds[mode].append(executor.run_plan(plan, batch).seconds)
    executor.probe = NO_PROBE
    telemetry.close()
    executor.close()
    return {"overhead": seconds, "thread_seconds": telemetry.thread_seconds}


def _world_one_worker(rank: int, port: int, settings: dict, run_root: str, out) -> None:
    """The overhead in a world of one at examples/train.py's model and batch shape (24 sequences, capacity 256)."""
    import torch
    import torch.distributed as dist

    from flexsp.runtime import GroupPool

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        spec = ModelSpec(vocab=256, hidden=64, layers=2, heads=8, kv_heads=2, ffn=128, tie_embeddings=True)
        cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=4 * 2 * 2 * 64 * 4,
                                alltoall_bandwidth={}, token_capacity=256, meta={"sharding": "full"})
        lengths = np.minimum(np.random.default_rng(0).lognormal(4.0, 0.9, 24).astype(int) + 8, 256)
        data = [((np.arange(n) * 7 + i) % 256).tolist() for i, n in enumerate(lengths)]
        result = _overhead(GroupPool(), spec, data, cost, flexsp.Cluster(1, 1), settings["pairs"],
                           Path(run_root) / "overhead-world1")
        out.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def measured(cfg: dict, settings: dict, run_root: Path, timeout: float) -> list[dict]:
    results = run_ranks(_worker, WORLD, (cfg, settings, str(run_root)), timeout)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors or len(results) < WORLD:
        raise SystemExit(f"ranks failed or timed out: {errors or sorted(set(range(WORLD)) - set(results))}")
    return [results[r] for r in range(WORLD)]


def overhead_table(name: str, ranks: list[dict], probe: list[dict], missed: list[str]) -> list[str]:
    """Markdown rows (and a printed line) of one overhead measurement; a missed target is added to ``missed``."""
    on = [max(r["overhead"]["on"][i] for r in ranks) for i in range(len(ranks[0]["overhead"]["on"]))]
    off = [max(r["overhead"]["off"][i] for r in ranks) for i in range(len(ranks[0]["overhead"]["off"]))]
    direct = median(r["probe_seconds"] / r["seconds"] for r in probe)
    thread = max(r["thread_seconds"] for r in ranks) / len(probe) / median(on)
    pairs = np.asarray(on) / np.asarray(off) - 1
    ab = float(np.median(pairs))
    spread = float(np.percentile(pairs, 75) - np.percentile(pairs, 25))
    ok_direct, ok_ab = direct <= OVERHEAD, ab <= OVERHEAD or ab <= spread
    if not ok_direct:
        missed.append(f"recorder time on the training thread ({name})")
    if not ok_ab:
        missed.append(f"recording on vs off ({name})")
    print(f"[CPU] overhead, {name}: recorder hooks {direct:.3%} of the step{'' if ok_direct else ' MISSED'}, "
          f"telemetry thread {thread:.3%}; step median on {median(on):.4f}s vs off {median(off):.4f}s "
          f"(paired {ab:+.2%}, interquartile {spread:.1%}){'' if ok_ab else ' MISSED'}")
    return [f"### {name}", "", "| figure | value | target |", "|---|---|---|",
            f"| recorder hooks: CPU time on the training thread, median share of the step | {direct:.3%} | <= 1%"
            f"{'' if ok_direct else ' **MISSED**'} |",
            f"| telemetry thread (gather, records): CPU time per step, share of the step | {thread:.3%} | |",
            f"| median step, recording off | {median(off):.4f} s | |",
            f"| median step, recording on | {median(on):.4f} s (paired median {ab:+.2%}) | <= 1% or within "
            f"the noise ({spread:.1%} interquartile range of the pairs){'' if ok_ab else ' **MISSED**'} |", ""]


def _fmt(values, spec=".3f") -> str:
    return " ".join(format(v, spec) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: few steps, tiny model")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown output (default: experiments/results/closed_loop_benchmark.md; with --quick a "
                             "temporary folder, $FLEXSP_QUICK_OUT if set)")
    args = parser.parse_args()
    # a quick run never overwrites the tracked results of a full one: it writes to the quick folder, named at exit
    args.out = resolve_out(args.out, args.quick, RESULTS / "closed_loop_benchmark.md")
    if args.quick:
        cfg = dict(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)
        settings = dict(capacity=96, batch=12, steps=5, pairs=3)
        sim_steps, strategy = 6, "greedy"
    else:
        cfg = dict(vocab=1024, hidden=128, layers=4, heads=8, kv_heads=4, ffn=384, tie_embeddings=True)
        settings = dict(capacity=256, batch=24, steps=20, pairs=30)
        sim_steps, strategy = 20, "flexsp"
    lines = [f"# Closed-loop benchmark ({'quick' if args.quick else 'full'})", ""]
    missed = []

    # 1. simulated
    sim = simulated(sim_steps, strategy)
    reached = next((i for i in range(sim_steps) if max(sim["refit error"][i:]) < BOUND), None)
    ok = reached is not None and reached <= WITHIN
    if not ok:
        missed.append("simulated refit error")
    saved = 1 - sum(sim["refit time"][WITHIN:]) / sum(sim["no refit time"][WITHIN:])   # same batches in both runs
    print(f"[SIM] refit error per step: {_fmt(sim['refit error'])}")
    print(f"[SIM] no-refit error per step: {_fmt(sim['no refit error'])}")
    print(f"[SIM] error below {BOUND:.0%} from step {reached} (target: within {WITHIN}){'' if ok else ' MISSED'}; "
          f"steps {WITHIN}.. take {saved:+.2%} less time with the refit")
    lines += ["## 1. Refit from a wrong cost model, simulated", "", f"**{SIM}.** Strategy `{strategy}`, 32 sequences "
              "per step (log-normal lengths, 128..30000 tokens).", "",
              "| step | median group error, no refit | with refit | step s (true machine), no refit | with refit |",
              "|---|---|---|---|---|"]
    for i in range(sim_steps):
        lines.append(f"| {i} | {sim['no refit error'][i]:.1%} | {sim['refit error'][i]:.1%} | "
                     f"{sim['no refit time'][i]:.3f} | {sim['refit time'][i]:.3f} |")
    lines += ["", f"Error below {BOUND:.0%} from step {reached} on (target: within {WITHIN} steps)"
              f"{'' if ok else ': **MISSED**'}. Steps {WITHIN}.. take {saved:+.2%} less time with the refit "
              f"(same batches).", ""]

    # 2 + 3. measured
    tmp = Path(tempfile.mkdtemp(prefix="flexsp-closed-loop-"))
    try:
        ranks = measured(cfg, settings, tmp, timeout=600 if args.quick else 1800)
        load = os.getloadavg()[0]
        runs = {name: read_records(tmp / name) for name in ("no-refit", "refit")}
        lines += ["## 2. Refit from a wrong cost model, measured", "", f"**{CPU}.** Load average at the end: "
                  f"{load:.1f}. TinyLM {cfg}, FSDP2 full sharding, greedy plans, {settings['batch']} sequences per "
                  f"step; the starting cost model is made up with alpha1 x10. Group times are each rank's "
                  f"main-thread CPU time (one intra-op thread).", "",
                  "| step | median group error, no refit | with refit | step s, no refit | with refit | cost version |",
                  "|---|---|---|---|---|---|"]
        for i, (a, b) in enumerate(zip(runs["no-refit"], runs["refit"])):
            lines.append(f"| {i} | {np.median(np.abs(group_errors(a))):.1%} | {np.median(np.abs(group_errors(b))):.1%}"
                         f" | {a['seconds']:.3f} | {b['seconds']:.3f} | {b['cost_version']} |")
        first = np.median(np.abs(group_errors(runs["refit"][0])))
        last = np.median(np.abs(np.concatenate([group_errors(r) for r in runs["refit"][-3:]])))
        stay = np.median(np.abs(np.concatenate([group_errors(r) for r in runs["no-refit"][-3:]])))
        print(f"[CPU] median group error: refit {first:.1%} -> {last:.1%} (last 3 steps); no refit {stay:.1%}; load {load:.1f}")
        lines += ["", f"Median group error over the last 3 steps: {last:.1%} with the refit (first step {first:.1%}), "
                  f"{stay:.1%} without. The two runs ran one after the other on a shared machine whose load moved "
                  f"while they ran: their step times differ by more than noise can explain only if a plan changed "
                  f"(greedy plans of a tiny model on a CPU change little with the cost model).", ""]

        world_one = run_ranks(_world_one_worker, 1, (settings, str(tmp)), timeout=600 if args.quick else 1800)
        if 0 not in world_one or "error" in world_one[0]:
            raise SystemExit(f"the world-of-one overhead run failed: {world_one.get(0)}")
        lines += ["## 3. Measurement overhead", "", f"**{CPU}.** Load average {load:.1f}. One fixed greedy plan, "
                  f"{settings['pairs']} pairs of steps with the recorder on and off, alternating step by step; "
                  f"step = slowest rank's `StepResult.seconds`. Hooks: the time the recorder's hooks take on the "
                  f"training thread (measured by the recorder); telemetry thread: its CPU time per step (gather, "
                  f"records, writing), which it can take from the training thread's interpreter.", ""]
        for name, results, folder in ((f"4 gloo ranks, {settings['batch']} sequences", ranks, "overhead"),
                                      ("a world of one, examples/train.py's model and 24 sequences", [world_one[0]],
                                       "overhead-world1")):
            lines += overhead_table(name, results, read_records(tmp / folder), missed)
        if not args.quick:   # the report of the refit run, for people to look at
            from flexsp.telemetry.report import write_report
            table, paths = write_report(tmp / "refit", out=args.out.parent / "closed_loop")
            lines += ["## `flexsp report` of the measured refit run", "", "<!-- generated: report -->", "```", table, "```",
                      "<!-- end: report -->", ""]
            lines += [f"![{p.stem}](closed_loop/{p.name})" for p in paths] + [""]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines.append(f"Targets missed: {', '.join(missed)}." if missed else "Every target met.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
