"""Replay FlexSP and baseline plans on this CPU: measured compute per group + modelled communication,
against the CPU-fitted cost model (``flexsp profile`` output, experiments/results/cpu_profile.json).

Steps: (1) measure the all-to-all bandwidth of a gloo world of ``--world`` processes on this machine
(the "measured table"); (2) plan ``--steps`` Wikipedia batches for ``--world`` ranks with the profile's
compute coefficients, that bandwidth and ``--capacity`` tokens per rank (the CPU has RAM to spare, so
the capacity mimics a memory-bound GPU); (3) replay every plan of every strategy on one CPU core;
(4) refit the compute coefficients from degree-1 replays made now, to tell machine drift since the
profile from the cost model's error. Everything here is measured on a CPU: it says nothing about GPUs.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

import flexsp  # noqa: E402
from flexsp.replay import format_groups, with_bandwidth  # noqa: E402

PROFILE = common.RESULTS / "cpu_profile.json"


def _bandwidth_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from flexsp.profile.bandwidth import alltoall_sweep
    from flexsp.profile.compute import DeviceSetup
    from flexsp.profile.fit import fit_bandwidth
    from flexsp.runtime.pool import GroupPool

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        samples = alltoall_sweep(GroupPool(), DeviceSetup.resolve("cpu", "fp32"), sizes, repeats=repeats, warmup=2)
        if rank == 0:
            fits = {}
            for d in sorted({s.degree for s in samples}):
                mine = [s for s in samples if s.degree == d]
                fits[d] = fit_bandwidth(d, [s.payload_bytes for s in mine], [s.seconds for s in mine],
                                        statistic="median").to_dict()
            Path(out).write_text(json.dumps(fits))
    except Exception as exc:
        Path(f"{out}.rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()


def measure_bandwidth(world: int, sizes: list[int], repeats: int, attempts: int = 2) -> dict[int, dict]:
    """Fitted all-to-all (latency, bandwidth) per degree of a ``world``-process gloo run on this machine;
    measured again (up to ``attempts`` times) when the fit refuses the timings (a loaded machine's noise can
    make a small message look slower than a large one), saying so on stderr."""
    for _ in range(attempts - 1):
        try:
            return _measure_bandwidth(world, sizes, repeats)
        except RuntimeError as exc:
            if "does not grow with message size" not in str(exc):
                raise
            print(f"bandwidth fit refused the timings ({str(exc)[:160]}); measuring again", file=sys.stderr)
    return _measure_bandwidth(world, sizes, repeats)


def _measure_bandwidth(world: int, sizes: list[int], repeats: int) -> dict[int, dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "bw.json")
        ctx = mp.get_context("spawn")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=_bandwidth_worker, args=(r, world, port, sizes, repeats, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        if any(p.exitcode != 0 for p in procs):
            errors = [e.read_text() for e in sorted(Path(tmp).glob("*.err"))]
            raise RuntimeError(f"bandwidth measurement failed: exit codes {[p.exitcode for p in procs]}: {errors}")
        return {int(d): f for d, f in json.loads(Path(out).read_text()).items()}


def main() -> int:
    p = common.parser(__doc__, "replay_cpu")
    p.add_argument("--profile", type=Path, default=PROFILE, help="CPU-fitted cost model (flexsp profile output)")
    p.add_argument("--world", type=int, default=4, help="ranks the plans are for and the gloo world measured")
    p.add_argument("--capacity", type=int, default=1024, help="token capacity per rank used for planning")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.world, args.steps, args.batch_size, args.repeats, args.capacity = 2, 1, 4, 1, 512
    started = time.time()

    import torch

    from flexsp.profile.compute import DeviceSetup
    from flexsp.profile.fit import fit_compute
    from flexsp.profile.shape import model_spec
    from flexsp.replay import Replayer, ReplayModel, plot_replay_gantt

    torch.set_num_threads(1)
    profile = flexsp.CostModel.load(args.profile)
    shape = profile.meta["model"]
    spec = model_spec(None, **{k: shape[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")})
    spec = dataclasses.replace(spec, name=str(shape.get("name", "custom")))
    sizes = [2**16, 2**18, 2**20, 2**21] if args.quick else [2**16, 2**18, 2**20, 2**22]
    fits = measure_bandwidth(args.world, sizes, repeats=3 if args.quick else 5)
    table = {d: f["bandwidth"] for d, f in fits.items()}
    cost = with_bandwidth(profile, table, f"gloo all-to-all measured in the same run on this machine ({args.world} processes)")
    cost = flexsp.CostModel.from_dict(dict(cost.to_dict(), token_capacity=args.capacity))
    cluster = flexsp.Cluster(args.world, args.world)
    context = args.world * args.capacity
    dist = common.distribution("wikipedia")
    strategies = (["flexsp", f"static:{args.world}"] if args.quick
                  else ["flexsp", "batchada", "dynamic-cp", f"static:{args.world}", f"static:{args.world // 2}"])
    setup = DeviceSetup.resolve("cpu", "fp32", "auto")
    replayer = Replayer(ReplayModel.from_spec(spec, setup), setup, repeats=args.repeats, warmup=1,
                        statistic="min", clock="cpu")

    rows, reports, first, plans = [], {}, {}, {}
    batches = list(common.batches(dist, args.steps, args.batch_size, context, args.world, args.seed))
    for name in strategies:
        simulated, replayed, errors, infeasible = 0.0, 0.0, [], False
        for step, lengths in enumerate(batches):
            plan = common.plan_time(lengths, cost, cluster, name, time_limit=0.5)
            if plan is None:
                infeasible = True
                break
            report = replayer.replay(plan, lengths, cost)
            reports.setdefault(name, []).append(report.to_dict())
            plans.setdefault(name, []).append((plan, lengths))
            first.setdefault(name, (report, lengths))
            simulated += report.predicted_time
            replayed += report.replayed_time
            errors += [abs(g.compute_error) for g in report.groups]
        if infeasible:
            rows.append({"strategy": name, "simulated (s)": "infeasible"})
            continue
        rows.append({"strategy": name, "simulated (s)": simulated, "replayed (s)": replayed,
                     "error": (simulated - replayed) / replayed, "group compute |err| mean": float(np.mean(errors)),
                     "group compute |err| max": float(np.max(errors))})

    # Same-session refit: degree-1 single sequences at the profile's lengths, timed now, fitted the profile's way.
    swept = [int(n) for n in profile.meta.get("lengths", [128, 256, 512, 1024])]
    if args.quick:
        swept = swept[:4]
    xs, ts = [], []
    for n in swept:
        samples = replayer.measure_group([n], 1)[1]
        xs += [n] * len(samples)
        ts += list(samples)
    refit = fit_compute(xs, ts, statistic="min")
    now = flexsp.CostModel.from_dict(dict(cost.to_dict(), alpha1=refit.alpha1, alpha2=refit.alpha2, beta1=refit.beta1))
    for row in rows:
        if "replayed (s)" not in row:
            continue
        # the same plans under the refitted compute coefficients, same communication
        total = sum(plan.time(lengths, now) for plan, lengths in plans[row["strategy"]])
        row["simulated, refit now (s)"] = total
        row["refit error"] = (total - row["replayed (s)"]) / row["replayed (s)"]

    # Per SP degree: does measured compute shrink as 1/d, as the cost model's form says?
    by_degree: dict[int, list[tuple[float, float]]] = {}
    for name, items in plans.items():
        for (plan, lengths), data in zip(items, reports[name]):
            for g in data["groups"]:
                group = plan.micro_batches[g["micro_batch"]].groups[g["group"]]
                refit_compute = now.group_time(lengths[list(group.seq_ids)], g["degree"]) - g["comm"]
                by_degree.setdefault(g["degree"], []).append(
                    (g["compute_error"], (refit_compute - g["compute"]) / g["compute"]))
    degree_rows = [{"SP degree": d, "groups": len(v), "profile error (mean)": f"{np.mean([a for a, _ in v]):+.1%}",
                    "refit error (mean)": f"{np.mean([b for _, b in v]):+.1%}",
                    "refit |error| max": f"{np.max(np.abs([b for _, b in v])):.1%}"}
                   for d, v in sorted(by_degree.items())]

    ref = next((r for r in rows if r["strategy"] == "flexsp"), None)
    for row in rows:
        if "replayed (s)" in row and ref is not None:
            row["flexsp speedup simulated"] = f"{row['simulated (s)'] / ref['simulated (s)']:.2f}x"
            row["flexsp speedup replayed"] = f"{row['replayed (s)'] / ref['replayed (s)']:.2f}x"
    columns = ["strategy", "simulated (s)", "replayed (s)", "error", "flexsp speedup simulated",
               "flexsp speedup replayed", "group compute |err| mean", "group compute |err| max",
               "simulated, refit now (s)", "refit error"]
    shown = [{c: (common.fmt(v, 3) if isinstance(v, float) and "err" not in c else
                  f"{v:+.1%}" if isinstance(v, float) and c in ("error", "refit error") else
                  f"{v:.1%}" if isinstance(v, float) else v) for c, v in row.items()} for row in rows]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    label = next(iter(first.values()))[0].meta["label"]
    bw_lines = "\n".join(f"| {d} | {f['bandwidth'] / 1e6:.1f} | {f['latency'] * 1e6:.0f} |" for d, f in fits.items())
    flexsp_report = first["flexsp"][0]
    body = f"""**Measured on a CPU** ({label}). Not a GPU figure.

Setup: model `{spec.name}` (layers {spec.layers}, hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads}, ffn
{spec.ffn}, vocab {spec.vocab}), the runtime's TinyLM; cost model `{args.profile.name}` (fitted by `flexsp profile`
on {profile.meta.get('date', '?')}, {profile.meta.get('device', '?')}, clock {profile.meta.get('clock', '?')}) with
the all-to-all bandwidths measured in the same run and a planning capacity of {args.capacity} tokens per rank; {args.world}
ranks; {args.steps} Wikipedia batch(es) of {args.batch_size} sequences (context {context}); every group replayed on
one core ({args.repeats} timed run(s) after 1 warm-up, minimum, CPU clock). "simulated" is the cost model's
makespan; "replayed" the makespan with each group's measured compute plus the same modelled communication, so
the two differ only in compute. "refit now" re-fits alpha1/alpha2/beta1 from degree-1 replays made in this run
(alpha1 {refit.alpha1:.3e}, alpha2 {refit.alpha2:.3e}, beta1 {refit.beta1:.3e}; profile: alpha1
{profile.alpha1:.3e}, alpha2 {profile.alpha2:.3e}, beta1 {profile.beta1:.3e}): the gap between the two errors is
drift of this shared machine since the profile, the rest is the cost model's form.

Measured gloo all-to-all ({args.world} processes on this machine):

| degree | bandwidth (MB/s) | latency (us) |
|---|---|---|
{bw_lines}

{common.markdown_table(shown, columns)}

Per-group compute error by SP degree, all strategies and steps (predicted compute = cost model group time
minus the modelled communication; error = (predicted - measured) / measured):

{common.markdown_table(degree_rows, list(degree_rows[0]))}

Groups of flexsp's first plan ([Gantt chart](replay_cpu.png), predicted above, replayed below):

{format_groups(flexsp_report)}
"""
    md = common.write_markdown(out / "replay_cpu.md", "Replay on one device: measured compute vs the CPU cost model",
                               body, started, args.quick, label="")   # the body says what was measured
    (out / "replay_cpu.json").write_text(json.dumps({"label": label, "bandwidth": {str(d): f for d, f in fits.items()},
                                                     "rows": rows, "reports": reports,
                                                     "refit": refit.to_dict()}, indent=1) + "\n")
    (out / "replay_cpu_bandwidth.json").write_text(json.dumps(
        {"alltoall_bandwidth": {str(d): bw for d, bw in table.items()},
         "meta": {"label": f"gloo all-to-all, {args.world} processes on this CPU machine (measured)",
                  "fits": {str(d): f for d, f in fits.items()}}}, indent=1) + "\n")
    cost.save(out / "replay_cpu_cost.json")   # what the plans were made with: profile + measured bandwidth + capacity
    plot_replay_gantt(flexsp_report, out / "replay_cpu.png",
                      title=f"flexsp, first Wikipedia batch, {args.world} ranks (CPU-measured compute)")
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
