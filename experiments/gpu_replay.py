"""The paper's end-to-end comparison with measured compute: plan for N GPUs with a measured preset, replay
every plan's groups on the one GPU at hand.

Every strategy of the e2e comparison (FlexSP, BatchAda, Megatron's dynamic-CP rule, static SP at N and
N/2; ``experiments/e2e_speedup.py``) plans the same seeded global batches for ``--gpus`` GPUs with a
measured preset (``flexsp.cost_from_preset``, default ``h200-llama3-8b``: compute and memory measured on
an H200, all-to-all and ring assumed from the documented ``nvlink-ib`` figures). Then every group of
every plan is replayed on this device (``flexsp.replay``: the busiest rank's forward and backward through
the runtime's model code, ``--run-layers`` of the blocks run and scaled), its communication modelled
from the same preset. The results put each strategy's replayed makespan and speedups beside the
simulated ones, with the share of the replayed step that is measured compute.

It fits a device-time budget: ``--budget`` seconds of this script's wall time (default 14 min, so the
run fits 15 minutes of one H200 with its start-up), replaying step by step (every strategy of a step
before the next step) and starting a replay only when its estimate (``flexsp.replay.budget``) still
fits. The results file is written after every replay; running the same command again resumes where
it stopped (same setting, same device), with the plans it saved, so a cut-short run loses one replay.

    python experiments/gpu_replay.py                    # one GPU: 64 GPUs planned, Llama-3-8B (2 of 32 layers)
    python experiments/gpu_replay.py --steps 6 --budget 3000 --gpus 128
    python experiments/gpu_replay.py --dry-run          # plans and the estimated device time, no replay
    python experiments/gpu_replay.py --quick            # CI, CPU: 8 GPUs planned, a tiny proxy model (plumbing)

Without a GPU (or with ``--quick``) the results go to a temporary folder, never to experiments/results/:
CPU timings say nothing about the preset's GPU. Megatron-LM (TP + CP) has no SP groups to replay and
is left out (``e2e_speedup.py`` simulates it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import flexsp
from flexsp.errors import FlexSPError
from flexsp.evaluation.simulate import plan_steps
from flexsp.inputs import parse_tokens
from flexsp.plan.specs import SHAPE_FIELDS, ModelSpec
from flexsp.replay.budget import BudgetClock, estimate_seconds

import common
from outputs import RESULTS, resolve_out

FORMAT, VERSION = "flexsp gpu_replay results", 1
# The quick mode's stand-in: a few ms per group on a CPU, heads enough for every degree of 8 GPUs. Its
# times are not the preset's model; quick mode checks the plumbing, never the calibration.
PROXY = ModelSpec(layers=2, hidden=64, heads=8, kv_heads=2, ffn=128, vocab=256, name="proxy (quick mode)")


def arguments():
    p = common.parser(__doc__, "gpu_replay")
    p.add_argument("--preset", default="h200-llama3-8b", help="measured preset to plan and model communication with")
    p.add_argument("--gpus", type=int, default=64, help="GPUs the plans are for (default 64)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--context", type=parse_tokens, default=384 * 1024, help="context limit (default 384K)")
    p.add_argument("--dataset", default="wikipedia")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="global batches (default 5)")
    p.add_argument("--strategies", default=None, help="comma list (default: flexsp, batchada, dynamic-cp, static:N, "
                                                      "static:N/2)")
    p.add_argument("--time-limit", type=float, default=1.0, help="FlexSP solver time limit per batch (s)")
    p.add_argument("--run-layers", type=int, default=2, help="blocks run per replay, scaled to the model's (default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget", type=float, default=840.0,
                   help="seconds of wall time for the whole run; no replay starts that would end past it (default 840)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    p.add_argument("--dry-run", action="store_true", help="plan and estimate the device time; replay nothing")
    p.add_argument("--restart", action="store_true", help="ignore a results file of an earlier run")
    args = p.parse_args()
    if args.quick:
        args.gpus, args.gpus_per_node, args.context, args.batch_size, args.steps = 8, 8, 2048, 8, 1
        # a time limit that does not bind on a loaded CI machine (a cut-short search plans worse), every proxy
        # block run (no scaling: a difference of two noisy CPU timings can come out negative), one warm-up
        args.time_limit, args.repeats, args.warmup, args.run_layers, args.device = 10.0, 1, 1, PROXY.layers, "cpu"
    return args


def strategies(args) -> list[str]:
    if args.strategies:
        return [s.strip() for s in args.strategies.split(",") if s.strip()]
    return ["flexsp", "batchada", "dynamic-cp", f"static:{args.gpus}", f"static:{args.gpus // 2}"]


def setting(args, cost: flexsp.CostModel, device: str) -> dict:
    """What identifies a run: a results file is resumed only for the same setting and device."""
    return {"preset": args.preset, "gpus": args.gpus, "gpus_per_node": args.gpus_per_node, "context": args.context,
            "dataset": args.dataset, "batch_size": args.batch_size, "steps": args.steps, "seed": args.seed,
            "strategies": strategies(args), "time_limit": args.time_limit, "run_layers": args.run_layers,
            "repeats": args.repeats, "warmup": args.warmup, "quick": args.quick, "device": device,
            "model": model_of(args, cost).shape()}


def plan_all(args, cost: flexsp.CostModel) -> list[dict]:
    """Every strategy on the same seeded batches (``common.batches``, as the e2e comparison draws them)."""
    cluster = flexsp.Cluster(args.gpus, args.gpus_per_node)
    names = strategies(args)
    batches = list(common.batches(common.distribution(args.dataset), args.steps, args.batch_size, args.context,
                                  args.gpus, args.seed))
    steps = []
    for lengths, outcomes in zip(batches, plan_steps(batches, cost, cluster, names, workers=args.workers,
                                                     config=flexsp.PlanConfig(time_limit=args.time_limit),
                                                     keep_plans=len(batches))):
        step = {"lengths": [int(n) for n in lengths], "plans": {}, "errors": {}}
        for name, outcome in zip(names, outcomes):
            if outcome.fatal is not None:
                raise outcome.fatal
            if outcome.error is not None:
                step["errors"][name] = outcome.error
            else:
                step["plans"][name] = outcome.plan.to_dict()
        steps.append(step)
    return steps


def load_state(path: Path, wanted: dict, restart: bool) -> dict | None:
    """The earlier run's results to resume, or None to start afresh."""
    if restart or not path.exists():
        return None
    state = json.loads(path.read_text())
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise SystemExit(f"{path} is not a {FORMAT} file of version {VERSION}; move it or pass --restart")
    if state["setting"] != wanted:
        changed = sorted(k for k in wanted if state["setting"].get(k) != wanted[k])
        raise SystemExit(f"{path} holds a run of another setting (differs in {', '.join(changed)}); pass --restart "
                         f"to replace it or --out elsewhere")
    return state


def save(state: dict, path: Path) -> None:
    """Write atomically: a run killed mid-write keeps the previous file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def model_of(args, cost: flexsp.CostModel) -> ModelSpec:
    """The model the preset was profiled on (``meta["model"]``); in quick mode the CPU proxy."""
    if args.quick:
        return PROXY
    shape = cost.meta["model"]
    return dataclasses.replace(ModelSpec(**{k: int(shape[k]) for k in SHAPE_FIELDS}), name=str(shape.get("name", "custom")))


def replay_model(args, spec: ModelSpec, setup):
    """``spec`` at ``--run-layers`` on ``setup``; the quick mode's proxy skips the check against the preset's shape."""
    from flexsp.replay import ReplayModel
    model = ReplayModel.from_spec(spec, setup, args.run_layers, seed=args.seed)
    return dataclasses.replace(model, shape=None) if args.quick else model


def replay_all(args, state: dict, cost: flexsp.CostModel, path: Path | None, clock: BudgetClock) -> None:
    """Replay every (step, strategy) not yet in ``state``, step by step, while the budget allows."""
    from flexsp.profile.compute import DeviceSetup
    from flexsp.replay import Replayer

    import torch

    if args.quick:
        torch.set_num_threads(1)          # a shared CI machine: one thread is the steadiest
    setup = DeviceSetup.resolve(args.device, "auto", "auto")
    spec = model_of(args, cost)
    model = replay_model(args, spec, setup)
    replayer = Replayer(model, setup, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
    runs = args.repeats + args.warmup
    for i, step in enumerate(state["steps"]):
        for name, data in step["plans"].items():
            key = f"{i}/{name}"
            if key in state["replays"]:
                continue
            plan = flexsp.Plan.from_dict(data)
            estimate = estimate_seconds(plan, step["lengths"], cost, spec, args.run_layers, runs)
            if not clock.fits(estimate):
                state["stopped"] = (f"device-time budget: {key} would take about {clock.expected(estimate):.0f} s with "
                                    f"{clock.budget - clock.elapsed:.0f} s left; run the same command again to resume")
                print(state["stopped"], flush=True)
                return
            started = time.monotonic()
            try:
                report = replayer.replay(plan, step["lengths"], cost)
            except (FlexSPError, torch.OutOfMemoryError) as exc:   # one plan this device cannot run: note it, go on
                state["replays"][key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
                print(f"step {i} {name} not replayed: {state['replays'][key]['error']}", flush=True)
                if setup.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            seconds = time.monotonic() - started
            clock.record(estimate, seconds)
            state["replays"][key] = dict(report.to_dict(), wall_s=seconds, estimate_s=estimate)
            state["device"] = report.meta
            print(f"replayed step {i} {name}: {report.replayed_time:.3f} s replayed vs {report.predicted_time:.3f} s "
                  f"simulated ({seconds:.1f} s on the device, estimated {estimate:.1f} s)", flush=True)
            if path is not None:
                save(state, path)
    state["stopped"] = None


def complete_steps(state: dict) -> list[int]:
    """Steps whose every plan was replayed (or found unreplayable): the ones speedups may compare."""
    return [i for i, step in enumerate(state["steps"])
            if all(f"{i}/{name}" in state["replays"] for name in step["plans"])]


def rows(state: dict) -> list[dict]:
    """Per strategy over the compared steps (every strategy replayed; all planned steps when none is):
    simulated and replayed totals, speedups, measured share, per-group compute errors."""
    steps = complete_steps(state) or ([] if state["replays"] else list(range(len(state["steps"]))))
    out = []
    for name in state["setting"]["strategies"]:
        failed = [state["replays"].get(f"{i}/{name}", {}).get("error") for i in steps]
        if not steps or any(name not in state["steps"][i]["plans"] for i in steps) or any(failed):
            error = next((step["errors"][name] for step in state["steps"] if name in step["errors"]),
                         next((f"not replayed: {e}" for e in failed if e), None))
            out.append({"strategy": name, "error": error or "not replayed"})
            continue
        row = {"strategy": name, "simulated": sum(state["steps"][i]["plans"][name]["predicted_time"] for i in steps)}
        reports = [state["replays"][f"{i}/{name}"] for i in steps if f"{i}/{name}" in state["replays"]]
        if reports:
            errors = [abs(g["compute_error"]) for r in reports for g in r["groups"]]
            replayed = sum(r["step"]["replayed_time"] for r in reports)
            compute = sum(r["step"]["measured_share"] * r["step"]["replayed_time"] for r in reports)
            row.update(replayed=replayed, measured_share=compute / replayed, error_mean=float(np.mean(errors)),
                       error_max=float(np.max(errors)), groups=sum(len(r["groups"]) for r in reports))
        out.append(row)
    reference = next((r for r in out if r["strategy"] == "flexsp" and "error" not in r), None)
    for r in out:
        if reference and "error" not in r:
            r["speedup_simulated"] = r["simulated"] / reference["simulated"]
            if "replayed" in r and "replayed" in reference:
                r["speedup_replayed"] = r["replayed"] / reference["replayed"]
    return out


def markdown(state: dict, table: list[dict], started: float, quick: bool) -> str:
    s, cost, device = state["setting"], state["cost_model"], state.get("device") or {}
    steps = complete_steps(state)
    measured_on = device.get("label", "nothing yet (no replay ran)")
    label = (f"**Measured compute, modelled communication** (replayed on one device; never an end-to-end cluster "
             f"measurement). Plans and simulated times: the measured preset `{s['preset']}` ({cost['provenance']}). "
             f"Replayed: {measured_on}; {min(s['run_layers'], s['model']['layers'])} of the model's {s['model']['layers']} blocks run"
             f"{' and scaled' if s['run_layers'] < s['model']['layers'] else ''}. "
             f"Modelled: all-to-all {cost['parts']['alltoall']}; ring {cost['parts']['ring']}.")
    if quick:
        label += (f" **Quick mode**: a CPU and a tiny proxy model ({PROXY.layers} layers, hidden {PROXY.hidden}) stand in "
                  f"for the GPU and the preset's model, so replayed times are not comparable with the simulated ones; "
                  f"it checks the plumbing only.")
    columns = ["strategy", "simulated (s)", "replayed (s)", "replayed / simulated", "FlexSP speedup simulated",
               "FlexSP speedup replayed", "measured share of replayed step", "group compute |err| mean / max"]
    lines = []
    for r in table:
        if "error" in r:
            lines.append({"strategy": r["strategy"], "simulated (s)": f"infeasible or not replayed: {r['error']}"})
            continue
        line = {"strategy": r["strategy"], "simulated (s)": common.fmt(r["simulated"], 3),
                "FlexSP speedup simulated": common.fmt(r.get("speedup_simulated", float("nan")), suffix="x")}
        if "replayed" in r:
            line.update({"replayed (s)": common.fmt(r["replayed"], 3),
                         "replayed / simulated": common.fmt(r["replayed"] / r["simulated"], 3),
                         "FlexSP speedup replayed": common.fmt(r.get("speedup_replayed", float("nan")), suffix="x"),
                         "measured share of replayed step": f"{r['measured_share']:.1%}",
                         "group compute |err| mean / max": f"{r['error_mean']:.1%} / {r['error_max']:.1%}"})
        else:
            line["replayed (s)"] = "not replayed"
        lines.append(line)
    stopped = state.get("stopped")
    body = (f"{label}\n\n{s['gpus']} GPUs planned ({s['gpus_per_node']} per node), {s['dataset']}, global batch {s['batch_size']}, "
            f"context {s['context']:,}, token capacity {cost['token_capacity']:.0f} per GPU; {len(steps)} of "
            f"{s['steps']} step(s) replayed for every strategy (totals are over those steps"
            f"{'; none yet, so the simulated columns cover every planned step' if not steps else ''}). FlexSP speedup = the "
            f"strategy's total over FlexSP's. Measured share: compute on the critical path over the replayed makespan "
            f"(the rest is modelled communication).\n\n"
            + common.markdown_table(lines, columns)
            + (f"\n\n**Incomplete**: stopped at the {stopped}." if stopped else ""))
    return body


def main() -> int:
    args = arguments()
    clock = BudgetClock(args.budget)
    cost = flexsp.cost_from_preset(args.preset, context=args.context, num_gpus=args.gpus,
                                   gpus_per_node=args.gpus_per_node)
    on_gpu = False
    if not args.dry_run:
        import torch
        on_gpu = args.device != "cpu" and torch.cuda.is_available()
        if args.device == "cuda" and not on_gpu:
            raise SystemExit("--device cuda: no CUDA device here")
    # a CPU run (or --quick, or --dry-run without a GPU) never writes into experiments/results
    out = resolve_out(args.out, args.quick or not on_gpu, RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.stem}_{args.preset}_{args.gpus}gpu"
    path = out / f"{stem}.json"
    device = "dry run" if args.dry_run else ("cuda" if on_gpu else "cpu")
    if on_gpu:
        import torch
        device = torch.cuda.get_device_name()
    wanted = setting(args, cost, device)
    state = load_state(path, wanted, args.restart)
    if state is None:
        state = {"format": FORMAT, "version": VERSION, "setting": wanted,
                 "cost_model": {"preset": args.preset, "provenance": cost.meta["provenance"]["summary"],
                                "parts": cost.meta["parts"], "token_capacity": cost.token_capacity,
                                "context_note": cost.meta.get("context_note")},
                 "measured": "compute per group on the device in 'device' (forward + backward of the busiest rank)",
                 "modelled": "all-to-all and ring communication, from the preset (see cost_model.parts)",
                 "steps": plan_all(args, cost), "replays": {}, "device": None, "stopped": None}
        print(f"planned {args.steps} step(s) x {len(wanted['strategies'])} strategies in {clock.elapsed:.0f} s", flush=True)
    else:
        print(f"resuming {path}: {len(state['replays'])} replay(s) done", flush=True)
    spec = model_of(args, cost)
    total = sum(estimate_seconds(flexsp.Plan.from_dict(d), step["lengths"], cost, spec, args.run_layers,
                                 args.repeats + args.warmup)
                for step in state["steps"] for d in step["plans"].values())
    print(f"estimated device time of every replay: {total:.0f} s (budget {args.budget:.0f} s; a GPU like the preset's)")
    if not args.dry_run:
        save(state, path)
        replay_all(args, state, cost, path, clock)
        save(state, path)
    body = markdown(state, rows(state), clock.started, args.quick)
    common.write_markdown(out / f"{stem}.md", f"The e2e comparison replayed with measured compute ({args.preset}, "
                          f"{args.gpus} GPUs)", body, time.time() - clock.elapsed, args.quick, label="")
    print((out / f"{stem}.md").read_text())
    print(f"wrote {path if not args.dry_run else out / (stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
