"""The ``flexsp profile`` subcommand: ``add_parser(subparsers)`` registers it, ``run(args)`` runs it.

One process profiles compute and memory; under ``torchrun`` every rank joins the all-to-all sweep
and the check, rank 0 fits, prints and writes. torch is imported inside ``run``, so registering the
subcommand costs a planner-only install nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from flexsp.errors import CostModelError, FlexSPError
from flexsp.inputs import integer, parse_sizes
from flexsp.plan.memory import SHARDINGS
from flexsp.profile.preflight import FIT_ERROR_LIMIT


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` on an ``argparse`` subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "profile", help="measure this hardware, fit a cost model JSON, report its error",
        description="Fit alpha1/alpha2/beta1 (compute), activation memory -> token_capacity, and all-to-all "
                    "bandwidth per SP degree (under torchrun) to this machine; save as a CostModel JSON that "
                    "--cost, plan_batch and CostModel.load accept. --check validates predictions on real steps.")
    m = p.add_argument_group("model (real layer shapes)")
    m.add_argument("--model", default="tiny", help="shape preset: tiny, small, llama-7b, llama-13b, llama3-8b, "
                                                    "llama3-70b (default tiny); flags below override fields")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{name}", type=int, default=None)
    m.add_argument("--hf-config", default=None, metavar="DIR|ARCH",
                   help="time your Hugging Face model instead: a directory holding its config.json (random init, "
                        "no weights needed), or a built-in tiny arch (llama, qwen2, qwen3, mistral, gemma, phi3); "
                        "needs the hf extra. Replaces --model and the shape flags")
    m.add_argument("--hf-attn", default="sdpa", help="the HF model's attn_implementation key (default sdpa)")
    m.add_argument("--run-layers", type=int, default=None,
                   help="run only this many blocks and scale up to --layers (for models that do not fit); a model "
                        "with windowed, chunked or linear-attention layers: this many layers of each kind, timed apart "
                        "(default 2)")
    d = p.add_argument_group("device")
    d.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    d.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    d.add_argument("--attention", default="auto", help="attention backend: auto, flash, sdpa")
    d.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default on CPU: 1, steady on a shared machine and what --clock cpu "
                        "needs; on GPU: torch's)")
    s = p.add_argument_group("sweeps")
    s.add_argument("--lengths", type=parse_sizes, default=None,
                   help="sequence lengths for the compute sweep (default CPU 128..4K, GPU 1K..32K)")
    s.add_argument("--memory-lengths", type=parse_sizes, default=None, help="lengths for the memory profile "
                                                                        "(default: the 3 longest sweep lengths)")
    s.add_argument("--comm-sizes", type=parse_sizes, default=None,
                   help="per-rank all-to-all bytes (default CPU 64K..4M, GPU 1M..256M)")
    s.add_argument("--ring-sizes", type=parse_sizes, default=None,
                   help="per-rank bytes of one ring hop (point to point, under torchrun; default: 1K, 16K and the "
                        "--comm-sizes, tiny ones so the per-message latency shows)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--statistic", default="median", choices=("median", "min"),
                   help="one time per point from its repeats: median, or min on a shared/noisy machine")
    s.add_argument("--clock", default=None, choices=("wall", "cpu"),
                   help="wall, or cpu: this process's CPU time, for a shared CPU box with --threads 1 (default: cpu "
                        "on CPU, wall on GPU)")
    s.add_argument("--force", action="store_true",
                   help=f"write the profile even when the compute fit's mean |relative error| is above "
                        f"{FIT_ERROR_LIMIT * 100:.0f}%% (it is refused otherwise: the timings were too noisy to plan with)")
    s.add_argument("--skip-comm", action="store_true", help="no all-to-all or ring sweep even under torchrun")
    s.add_argument("--interconnect", default="auto",
                   help="fill the SP degrees this run could not measure (all-to-all bandwidth, ring axis) from a "
                        "documented preset, marked as assumed in the JSON: nvlink-ib, a100-nvlink-ib, pcie (see "
                        "flexsp/profile/interconnect.py for figures and sources), none; default auto: nvlink-ib on "
                        "one process, none under torchrun")
    c = p.add_argument_group("memory model")
    c.add_argument("--memory-gb", type=float, default=None, help="memory per GPU in GiB (default: the device's)")
    c.add_argument("--usable", type=float, default=0.9, help="usable fraction of it (default 0.9)")
    c.add_argument("--sharding", default="full", choices=SHARDINGS,
                   help="how model states are sharded over the GPUs (flexsp.plan.memory; default full)")
    c.add_argument("--num-gpus", type=int, default=None, help="GPUs sharding model states (default: world size)")
    c.add_argument("--gpus-per-node", type=int, default=None,
                   help="topology for intra/inter-node labels (default: LOCAL_WORLD_SIZE or world size)")
    v = p.add_argument_group("validation")
    v.add_argument("--check", default=None, metavar="PLAN.json|auto",
                   help="run a plan's groups and compare measured to predicted times; 'auto' plans a few "
                        "held-out batches with the fitted model")
    v.add_argument("--check-lengths", type=Path, default=None, help="the lengths file the plan was made for")
    v.add_argument("--cost", type=Path, default=None,
                   help="check this saved cost model instead of profiling (needs --check)")
    v.add_argument("--allow-shape-mismatch", action="store_true",
                   help="warn instead of failing when --cost was profiled on another model shape")
    p.add_argument("-o", "--output", type=Path, default=Path("cost_profile.json"), help="cost model JSON to write")
    p.add_argument("--report", type=Path, default=None, help="also write every measurement as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except FlexSPError as exc:
        print(f"flexsp profile: error: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------
def _init_distributed(device_type: str) -> bool:
    """Join the torchrun world if there is one; True if this call created the process group."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from datetime import timedelta
    # Other ranks wait while rank 0 sweeps compute and memory: longer than the default 10 minutes on big models.
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(hours=2))
    return True


def _teardown(pool, ok: bool) -> None:
    """Destroy the process groups this command made, subgroups first, after every rank is done: left
    to interpreter exit, gloo's threads and the groups go down in any order, an abort about one run in three."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    if ok:
        dist.barrier()
    if pool is not None:
        pool.close()   # its groups, subgroups first
    dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    import torch

    from flexsp.errors import CostModelError

    if args.cost is not None and args.check is None:
        raise CostModelError("--cost only makes sense with --check (validate a saved profile)")
    if args.check not in (None, "auto") and args.check_lengths is None:   # before minutes of measuring, not after
        raise CostModelError("--check PLAN.json needs --check-lengths FILE: the lengths the plan was made for")
    if args.interconnect not in ("auto", "none"):
        from flexsp.profile.interconnect import get_interconnect
        get_interconnect(args.interconnect)          # a bad name fails before any measuring
    for name in ("repeats", "warmup"):
        if getattr(args, name) < (1 if name == "repeats" else 0):
            raise CostModelError(f"--{name} must be >= {1 if name == 'repeats' else 0}, got {getattr(args, name)}")
    _check_before_measuring(args)
    requested = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    created = _init_distributed("cuda" if requested.startswith("cuda") else "cpu")
    state: dict[str, Any] = {"pool": None, "ok": False}
    try:
        result = _run_in_world(args, requested, state)
        state["ok"] = True
        return result
    finally:
        if created:
            _teardown(state["pool"], state["ok"])


def _check_before_measuring(args: argparse.Namespace) -> None:
    """Every setting a sweep would trip on, checked before the first measurement (minutes on a big model):
    the device and dtype, the counts, the memory fraction, and that the outputs can be written."""
    import math

    import torch

    from flexsp.errors import CostModelError
    from flexsp.inputs import writable_file
    from flexsp.profile.compute import DTYPES
    if args.device not in ("auto", "cpu", "cuda") and not (args.device.startswith("cuda:") and args.device[5:].isdigit()):
        raise CostModelError(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CostModelError(f"--device {args.device}: no CUDA device is available here")
    if args.device.startswith("cuda:") and int(args.device[5:]) >= torch.cuda.device_count():
        raise CostModelError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise CostModelError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {args.dtype!r}")
    for name in ("run_layers", "num_gpus", "gpus_per_node"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CostModelError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.usable <= 1:
        raise CostModelError(f"--usable must be a fraction in (0, 1], got {args.usable}")
    if args.memory_gb is not None and not (math.isfinite(args.memory_gb) and args.memory_gb > 0):
        raise CostModelError(f"--memory-gb must be > 0 GiB, got {args.memory_gb}")
    memory_lengths = _memory_lengths(args, args.lengths or [])
    if (args.memory_lengths or args.lengths) and len(set(memory_lengths)) < 2:
        raise CostModelError(f"the memory profile fits a slope and needs 2 distinct lengths, got {memory_lengths} "
                             f"({'--memory-lengths' if args.memory_lengths else 'the longest 3 of --lengths'})")
    if args.check is None:   # --check validates a saved profile and writes no cost model
        writable_file(args.output, "cost model", CostModelError)
    if args.report is not None:
        writable_file(args.report, "--report", CostModelError)


def _run_in_world(args: argparse.Namespace, requested: str, state: dict[str, Any]) -> int:
    import torch

    from flexsp.errors import CostModelError
    from flexsp.plan.cost import CostModel
    from flexsp.profile.compute import DeviceSetup, GroupRunner
    from flexsp.profile.shape import check_model_shape
    from flexsp.runtime.pool import GroupPool

    if args.threads is not None and args.threads < 1:
        raise CostModelError(f"--threads must be >= 1, got {args.threads}")
    setup = DeviceSetup.resolve(args.device, args.dtype, args.attention)
    on_cpu = setup.device.type == "cpu"
    # CPU-safe defaults: one thread timed by this process's CPU clock (others' load on a shared box is left
    # out); the default torch threads + wall clock gave a 57% mean fit error where these gave 2.8%.
    args.clock = args.clock or ("cpu" if on_cpu else "wall")
    threads = args.threads if args.threads is not None else (1 if on_cpu else None)
    if threads is not None:
        torch.set_num_threads(threads)
    spec, build = _model(args, setup)
    pool = state["pool"] = GroupPool()
    rank0 = pool.rank == 0
    say = (lambda msg: None) if args.quiet or not rank0 else (lambda msg: print(msg, flush=True))
    gpus_per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", pool.world_size))
    if args.cost is None:   # before building the model or sweeping: do its states fit the device at all?
        from flexsp.profile.memory import device_memory_bytes
        from flexsp.profile.preflight import check_states_fit
        check_states_fit(spec, args.memory_gb * 2**30 if args.memory_gb else device_memory_bytes(setup.device),
                         args.usable, args.sharding, args.num_gpus or pool.world_size)
    runner = GroupRunner(spec, setup, args.run_layers, seed=args.seed, clock=args.clock, build=build)
    say(f"flexsp profile: {spec.name} (layers {spec.layers}, hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads}, "
        f"ffn {spec.ffn}, vocab {spec.vocab}; {spec.params / 1e6:.1f} M params), running {runner.run_layers} "
        f"block(s) x{runner.scale:g}, on {setup.name}, {str(setup.dtype).replace('torch.', '')}, "
        f"world {pool.world_size}")

    report: dict[str, Any] = {}
    if args.cost is not None:
        cost = CostModel.load(args.cost)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_model_shape(cost, spec, strict=not args.allow_shape_mismatch)
        for w in caught:
            say(f"warning: {w.message}")
    else:
        cost = _profile(args, spec, setup, runner, pool, gpus_per_node, say, report)

    if args.check is not None:
        check = _check(args, cost, runner, pool, gpus_per_node, say)
        report["check"] = check.to_dict()
        meta = dict(cost.meta, check={"plan": args.check, "mean_abs_rel_error": check.mean_abs_error,
                                      "max_abs_rel_error": check.max_abs_error, "groups": len(check.groups),
                                      "skipped_groups": len(check.skipped)})
        cost = CostModel.from_dict(dict(cost.to_dict(), meta=meta))
    if rank0:
        if args.cost is None:
            cost.save(args.output)
            say(f"wrote {args.output}")
        if args.report is not None:
            args.report.write_text(json.dumps(dict(report, cost_model=cost.to_dict()), indent=1) + "\n")
            say(f"wrote {args.report}")
    return 0   # the caller's teardown waits for every rank


def _model(args: argparse.Namespace, setup):
    """(ModelSpec, build) - ``build`` None means the runtime's TinyLM at the spec's shapes."""
    from flexsp.profile.shape import model_spec
    shape = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": getattr(args, "kv_heads"),
             "ffn": args.ffn, "vocab": args.vocab}
    if args.hf_config is None:
        spec = model_spec(args.model, **shape)
        if any(k.mixer in ("window", "chunk") for k in spec.kind_counts()):   # each layer with its own mask
            from flexsp.profile.kinds import mixed_builder
            return spec, mixed_builder(spec)
        return spec, None
    given = sorted(k for k, v in shape.items() if v is not None)
    if given or args.model != "tiny":
        raise FlexSPError(f"--hf-config takes the shape from the model's config; drop --model/{given or ''}")
    try:
        from flexsp.profile.compute import hf_builder
        lengths = args.lengths or []
        return hf_builder(args.hf_config, max_seqlen=max(lengths + (args.memory_lengths or []), default=None)
                          or (32768 if setup.device.type == "cuda" else 2048), attn_implementation=args.hf_attn)
    except ImportError as exc:
        raise FlexSPError(f"--hf-config needs transformers (pip install 'flexsp[hf]'): {exc}") from None


def _profile(args, spec, setup, runner, pool, gpus_per_node, say, report):
    import torch
    import torch.distributed as dist

    from flexsp.plan.cost import CostModel
    from flexsp.profile.assemble import assemble_cost_model
    from flexsp.profile.fit import fit_bandwidth

    on_gpu = setup.device.type == "cuda"
    lengths = sorted(set(args.lengths or ([1024, 2048, 4096, 8192, 16384, 32768] if on_gpu
                                          else [128, 256, 512, 768, 1024, 1536, 2048])))
    if _per_kind(spec):
        from flexsp.profile.kinds import kind_lengths
        lengths, added = kind_lengths(lengths, spec)
        if added:
            say(f"compute: lengths {added} added below the model's windows/chunks (their pair term and linear term "
                f"are told apart only there)")
    payload: list[Any] = [None]
    if pool.rank == 0:   # compute and memory on one device; the others wait (no interference)
        try:
            payload = [_sweep_on_rank0(args, runner, setup, spec, pool, lengths, on_gpu, say)]
        except FlexSPError as exc:   # shared below, so every rank stops with it instead of waiting
            payload = [exc]
    if dist.is_initialized():
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], FlexSPError):
        raise payload[0]
    compute, mem, cap, estimates, kinds = payload[0]
    if kinds is not None:
        _print_kinds(kinds, say)
    _print_compute(compute, say)
    say(f"memory: {mem.bytes_per_token / 2**10:.2f} KiB activations per token "
        f"({'ESTIMATE: ' if mem.estimate else ''}{mem.method}), model states {cap.model_state_bytes / 2**30:.3f} GiB "
        f"(sharding {cap.sharding} over {cap.num_gpus}), {cap.memory_bytes / 2**30:.1f} GiB x {cap.usable_fraction} "
        f"-> token_capacity {cap.token_capacity}")

    bandwidths, ring, ring_layout = [], None, None
    if pool.world_size > 1 and not args.skip_comm:
        from flexsp.profile.bandwidth import alltoall_sweep, link_kind
        sizes = args.comm_sizes or ([2**20, 2**22, 2**24, 2**26, 2**28] if on_gpu else [2**16, 2**18, 2**20, 2**22])
        samples = alltoall_sweep(pool, setup, sizes, repeats=max(args.repeats, 3), warmup=args.warmup + 1, progress=say)
        for degree in sorted({s.degree for s in samples}):
            mine = [s for s in samples if s.degree == degree]
            bandwidths.append(fit_bandwidth(degree, [s.payload_bytes for s in mine], [s.seconds for s in mine],
                                            statistic=args.statistic))
        _print_comm(bandwidths, gpus_per_node, say, link_kind)
        ring, ring_layout = _ring(args, pool, setup, sizes, say)
    elif pool.world_size == 1:
        say("all-to-all: world of 1 process, nothing to measure (run under torchrun for bandwidths)")

    environment = {"device": setup.name, "device_type": setup.device.type, "torch": torch.__version__,
                   "dtype": str(setup.dtype).replace("torch.", ""), "attention": setup.backend,
                   "world_size": pool.world_size, "run_layers": runner.run_layers,
                   "layer_scale": runner.scale, "lengths": lengths, "repeats": args.repeats,
                   "statistic": args.statistic, "clock": args.clock, "threads": torch.get_num_threads() if not on_gpu else None,
                   "label": "CPU profile: not representative of GPU training" if not on_gpu else "GPU profile"}
    cost: CostModel = assemble_cost_model(
        spec, compute, cap.token_capacity, bandwidths=bandwidths, bytes_per_element=setup.bytes_per_element,
        gpus_per_node=gpus_per_node if bandwidths else None, memory=dict(mem.to_dict(), **cap.to_dict()),
        environment=environment, estimates=estimates, ring=ring, ring_layout=ring_layout, kinds=kinds)
    if kinds is not None:
        report["kinds"] = [k.to_dict() for k in kinds.kinds]
    report.update(compute=compute.to_dict(), memory=mem.to_dict(), capacity=cap.to_dict(),
                  comm=[b.to_dict() for b in bandwidths], ring=ring.to_dict() if ring is not None else None)
    chosen = args.interconnect if args.interconnect != "auto" else ("nvlink-ib" if pool.world_size == 1 else "none")
    if chosen != "none":
        from flexsp.profile.interconnect import with_interconnect
        cost = with_interconnect(cost, spec, chosen, setup.bytes_per_element,
                                 gpus_per_node=args.gpus_per_node)
        assumed = cost.meta["assumed"]
        say(f"interconnect: ASSUMED from the {chosen} preset for degrees {assumed['degrees'][0]}.."
            f"{assumed['degrees'][-1]} ({assumed['source']}); measured degrees kept: "
            f"{sorted(b.degree for b in bandwidths) or 'none'}; ring axis "
            f"{'measured, kept' if ring is not None else 'assumed from the preset'}")
    return cost


def _ring(args, pool, setup, comm_sizes, say):
    """The ring sweep and its fit: (BandwidthFit, layout dict), or (None, None) with nothing to time."""
    from flexsp.profile.fit import fit_bandwidth
    from flexsp.profile.ring import ring_sweep
    sizes = sorted(set(args.ring_sizes or [2**10, 2**14, *comm_sizes]))
    layout, samples = ring_sweep(pool, setup, sizes, repeats=max(args.repeats, 3), warmup=args.warmup + 1,
                                 progress=say)
    if layout is None:
        say("ring: no pooled degree above 1, nothing to measure")
        return None, None
    fit = fit_bandwidth(layout.size, [s.payload_bytes for s in samples], [s.seconds for s in samples],
                        statistic=args.statistic, what="ring")
    _print_ring(fit, layout, say)
    return fit, layout.to_dict()


def _sweep_on_rank0(args, runner, setup, spec, pool, lengths, on_gpu, say):
    """Compute and memory profile on rank 0 alone: (compute fit, memory profile, capacity, estimates)."""
    from flexsp.profile.compute import compute_sweep, matmul_rate
    from flexsp.profile.fit import fit_compute
    from flexsp.profile.memory import activation_profile, capacity, device_memory_bytes
    from flexsp.errors import CostModelError
    from flexsp.profile.preflight import duration, sweep_flops, sweep_seconds

    estimates = []
    memory_lengths = _memory_lengths(args, lengths)
    _check_lengths_fit(lengths, memory_lengths, spec, device_memory_bytes(setup.device), setup.device)

    runs = args.warmup + args.repeats
    swept = runner.spec
    if _per_kind(spec):     # the models with --run-layers (default 2) layers of each kind, not the whole stack
        from flexsp.profile.kinds import timed_kinds
        swept = spec.with_layers(max(1, args.run_layers or 2) * len(timed_kinds(spec)))
    rate, flops = matmul_rate(setup), sweep_flops(lengths, runs, memory_lengths, swept)
    say(f"estimate: the sweep takes at least {duration(flops / rate)} ({flops / 1e12:.3g} TFLOP at this device's "
        f"{rate / 1e12:.3g} TFLOP/s of a bare matmul; refined after the first run)")

    def estimate(first_length: int, seconds: float) -> None:
        total = sweep_seconds(runner.spec, lengths, runs, memory_lengths, first_length, seconds)
        say(f"estimate: the sweep takes about {duration(total)} ({len(lengths)} lengths x {runs} "
            f"runs + {len(memory_lengths)} memory runs; one {first_length}-token run took {seconds:.2f} s, the others "
            f"scaled by their FLOPs)")

    kinds, cause = None, "the timings are too noisy to plan with"
    if _per_kind(spec):
        compute, kinds = _kind_profile(args, spec, setup, lengths, say)
        worst = max((k for k in kinds.kinds if k.points), key=lambda k: k.mean_abs_error)
        error, what = max((compute.mean_abs_error, "compute fit"), (worst.mean_abs_error, f"{worst.name} layer fit"))
        if what != "compute fit" and worst.mixer in ("window", "chunk"):
            cause = (f"the timings are too noisy, or this device's {worst.mixer} kernel grows in a way neither its "
                     f"pairs nor s^2 describe (the CPU's explicit window path slows past the cache); either way too "
                     f"far off to plan with")
    else:
        sweep = compute_sweep(runner, lengths, repeats=args.repeats, warmup=args.warmup, progress=say, first=estimate)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compute = fit_compute(sweep.lengths, sweep.seconds, statistic=args.statistic)
        for w in caught:
            say(f"warning: {w.message}")
        error, what = compute.mean_abs_error, "compute fit"
    if error > FIT_ERROR_LIMIT:
        if not args.force:       # printed here: the refusal below ends the run before the usual print
            if kinds is not None:
                _print_kinds(kinds, say)
            _print_compute(compute, say)
        noisy = (f"the {what}'s mean |relative error| is {error:.1%} (compute fit max "
                 f"{compute.max_abs_error:.1%}), above the {FIT_ERROR_LIMIT:.0%} limit: {cause} "
                 f"({'--threads 1 --clock cpu --statistic min, ' if not on_gpu else ''}more --repeats, an idle "
                 f"machine)")
        if not args.force:
            raise CostModelError(f"{noisy}; --force writes it anyway")
        say(f"WARNING: {noisy}; written anyway (--force), marked in the JSON's meta")
        estimates.append(f"compute fit above the {FIT_ERROR_LIMIT:.0%} error limit (--force)")
    mem = activation_profile(runner, memory_lengths)
    memory_bytes = args.memory_gb * 2**30 if args.memory_gb else device_memory_bytes(setup.device)
    cap = capacity(spec.params, mem.bytes_per_token, memory_bytes, sharding=args.sharding,
                   num_gpus=args.num_gpus or pool.world_size, usable_fraction=args.usable)
    if mem.estimate:
        estimates.append("activation memory (CPU saved-tensor estimate)")
    if not on_gpu:
        estimates.append("device memory (CPU RAM stands in for GPU memory)" if not args.memory_gb
                         else "device memory (given, CPU run)")
    return compute, mem, cap, estimates, kinds


def _memory_lengths(args: argparse.Namespace, lengths: list[int]) -> list[int]:
    """The memory profile's lengths: ``--memory-lengths``, else the 3 longest of the sweep's."""
    return args.memory_lengths or sorted(set(lengths))[-3:]


def _check_lengths_fit(lengths: list[int], memory_lengths: list[int], spec, device_bytes: float, device) -> None:
    """Refuse a length whose hidden states alone (2 bytes x hidden per token, one copy: far below what a layer
    saves) exceed the device's memory, before a run asks the allocator for terabytes."""
    from flexsp.errors import CostModelError
    for flag, values in (("--lengths", lengths), ("--memory-lengths", memory_lengths)):
        longest = max(values)
        if 2.0 * spec.hidden * longest > device_bytes:
            raise CostModelError(f"{flag}: a {longest:,}-token sequence's hidden states alone need "
                                 f"{2.0 * spec.hidden * longest / 2**30:,.0f} GiB, more than this {device.type} "
                                 f"device's {device_bytes / 2**30:,.0f} GiB; profile shorter lengths")


def _per_kind(spec) -> bool:
    """Whether the model's layers differ in their mixer, so a layer of each kind is timed apart."""
    return any(k.mixer != "full" for k in spec.kind_counts())


def _kind_profile(args, spec, setup, lengths, say):
    """A layer of each kind timed and fitted apart (``flexsp.profile.kinds``): (whole-model fit, KindsModel)."""
    from flexsp.profile.compute import CLOCKS
    from flexsp.profile.kinds import fit_sweep, hf_kind_builder, kind_sweep, timed_kinds, tiny_builder

    blocks = max(1, args.run_layers or 2)
    kinds = timed_kinds(spec)
    if args.hf_config is None:
        builders = {k: tiny_builder(spec, k) for k, _ in kinds}
    else:
        max_seqlen = max(lengths)
        builders = {k: hf_kind_builder(args.hf_config, spec, k, max_seqlen=max_seqlen,
                                       attn_implementation=args.hf_attn) for k, _ in kinds}
    for kind, _ in kinds:
        if kind.mixer in ("window", "chunk") and max(lengths) <= kind.size:
            say(f"compute: no length above {kind.describe()}: beyond it the fit extrapolates its pair count (a kernel "
                f"that skips what the {kind.mixer} masks; add longer --lengths to measure it)")
    say(f"compute: a layer of each kind timed apart ({', '.join(f'{n} x {k.describe()}' for k, n in kinds)}): the "
        f"model without layers and with {blocks} layer(s) of each kind, at every length")
    sweep = kind_sweep(spec, setup, lengths, blocks=blocks, repeats=args.repeats, warmup=args.warmup,
                       clock=CLOCKS[args.clock], seed=args.seed, builders=builders, progress=say)
    for kind, count, why in sweep.untimed:
        say(f"compute: NOT TIMED: {count} x {kind.describe()} layers: {why}")
    model = fit_sweep(sweep, statistic=args.statistic)
    return model.total, model


def _check(args, cost, runner, pool, gpus_per_node, say):
    import numpy as np

    from flexsp.errors import CostModelError
    from flexsp.plan.lengths import load_lengths
    from flexsp.plan.planner import plan_batch
    from flexsp.plan.types import Plan
    from flexsp.profile.check import CheckReport, check_plan

    if args.check == "auto":
        # Held-out batches: random lengths inside the swept range, planned by the real planner.
        swept = _swept_lengths(cost)
        rng = np.random.default_rng(args.seed + 1)
        cluster = planning_cluster(pool.world_size, gpus_per_node)
        plans = [None]
        if pool.rank == 0:   # a time-limited search may differ between ranks: plan once, broadcast
            try:
                plans = []
                for _ in range(6):
                    n = int(rng.integers(1, 5))
                    lengths = np.exp(rng.uniform(np.log(min(swept)), np.log(max(swept)), n)).astype(int)
                    plans.append((plan_batch(lengths, cost, cluster, "flexsp", time_limit=0.5).to_dict(),
                                  lengths.tolist()))
            except FlexSPError as exc:   # every rank raises it, none waits in the broadcast
                plans = exc
        if pool.world_size > 1:
            import torch.distributed as dist
            box = [plans]
            dist.broadcast_object_list(box, src=0)
            plans = box[0]
        if isinstance(plans, FlexSPError):
            raise plans
        plans = [(Plan.from_dict(p), lengths) for p, lengths in plans]
    else:
        if args.check_lengths is None:
            raise CostModelError("--check PLAN.json needs --check-lengths FILE: the lengths the plan was made for")
        plans = [(Plan.load(args.check), load_lengths(args.check_lengths).tolist())]
    reports = [check_plan(plan, lengths, cost, runner, pool, repeats=args.repeats, warmup=args.warmup,
                          statistic=args.statistic, progress=say)
               for plan, lengths in plans]
    merged = CheckReport(tuple(g for r in reports for g in r.groups), tuple(s for r in reports for s in r.skipped))
    if merged.skipped:
        say(f"check: {len(merged.skipped)} group(s) wider than this world of {pool.world_size} or with a ring axis "
            f"(the check runs Ulysses only) were skipped")
    if merged.groups:
        say(f"check: {len(merged.groups)} groups, |relative error| mean {merged.mean_abs_error:.1%}, "
            f"max {merged.max_abs_error:.1%} (the paper reports < 6% on A100s)")
    return merged


def planning_cluster(world_size: int, gpus_per_node: int):
    """The ``Cluster`` to plan check batches for. A world that fits in one node (3 or 6 local ranks) is
    one partial node of the next power-of-two size; several nodes need a power-of-two node size."""
    from flexsp.plan.cluster import Cluster
    if world_size <= gpus_per_node:
        return Cluster(world_size, 1 << (world_size - 1).bit_length())
    return Cluster(world_size, gpus_per_node)


def _print_compute(fit, say) -> None:
    say("compute fit: time(s) = alpha1*s^2 + alpha2*s + beta1  (one sequence, SP degree 1, fwd+bwd)")
    say(f"  {'tokens':>8} {'measured ms':>12} {'fitted ms':>12} {'rel err':>8}")
    for p in fit.points:
        say(f"  {int(p.x):>8} {p.measured * 1e3:>12.3f} {p.predicted * 1e3:>12.3f} {p.rel_error:>+8.2%}")
    say(f"  alpha1 = {fit.alpha1:.4e} s/token^2, alpha2 = {fit.alpha2:.4e} s/token, beta1 = {fit.beta1:.4e} s")
    say(f"  |relative error| mean {fit.mean_abs_error:.2%}, max {fit.max_abs_error:.2%}")


def _print_kinds(model, say) -> None:
    say("layer kinds: one layer's time(s) = alpha * work(s) + alpha2*s + beta1  (work: s^2, or the pairs its "
        "window/chunk leaves, or none)")
    say(f"  {'kind':>12} {'layers':>6} {'work':>6} {'alpha':>11} {'alpha2':>11} {'beta1':>11} {'mean err':>9} "
        f"{'max err':>8}")
    for k in model.kinds:
        if k.estimated:
            say(f"  {k.name:>12} {k.layers:>6}   ESTIMATE, {k.estimated}")
            continue
        say(f"  {k.name:>12} {k.layers:>6} {k.work:>6} {k.alpha:>11.4e} {k.alpha2:>11.4e} {k.beta1:>11.4e} "
            f"{k.mean_abs_error:>9.2%} {k.max_abs_error:>8.2%}")
    for k in model.kinds:
        if k.mixer in ("window", "chunk") and k.work == "square":
            say(f"  note: the {k.name} layers' kernel on this device computes the whole masked score matrix "
                f"(their time grows as s^2): costed in alpha1, not {k.mixer}_alpha")
    terms = [f"window_alpha[{w}] = {a:.4e}" for w, a in model.window_alpha.items()]
    terms += [f"chunk_alpha[{c}] = {a:.4e}" for c, a in model.chunk_alpha.items()]
    say(f"  summed over the model (with embedding, head and loss){': ' + ', '.join(terms) if terms else ''}; "
        f"alpha1 below covers the s^2 kinds only:")


def _print_comm(fits, gpus_per_node, say, link_kind) -> None:
    say(f"all-to-all fit: time = latency + bytes / bandwidth  (bytes = one rank's payload; {gpus_per_node} per node)")
    say(f"  {'degree':>6} {'link':>10} {'latency us':>11} {'GB/s':>9} {'max err':>8}")
    for f in fits:
        say(f"  {f.degree:>6} {link_kind(f.degree, gpus_per_node):>10} {f.latency * 1e6:>11.1f} "
            f"{f.bandwidth / 1e9:>9.3f} {f.max_abs_error:>8.2%}")


def _print_ring(fit, layout, say) -> None:
    say(f"ring fit: time = latency + bytes / bandwidth  (one hop: every rank sends its next ring rank, bytes = "
        f"one rank's message; {len(layout.rings)} ring(s) of {layout.size}, stride {layout.stride}, {layout.link})")
    say(f"  {'bytes':>11} {'measured us':>12} {'fitted us':>12} {'rel err':>8}")
    for p in fit.points:
        say(f"  {int(p.x):>11} {p.measured * 1e6:>12.1f} {p.predicted * 1e6:>12.1f} {p.rel_error:>+8.2%}")
    say(f"  latency {fit.latency * 1e6:.1f} us per hop, bandwidth {fit.bandwidth / 1e9:.3f} GB/s; |relative error| "
        f"mean {fit.mean_abs_error:.2%}, max {fit.max_abs_error:.2%}")


def _swept_lengths(cost) -> list[int]:
    """The lengths a profile swept (its ``meta["lengths"]``, from a file: checked), else 256..4,096 tokens."""
    swept = cost.meta.get("lengths")
    if swept is None:
        return [256, 4096]
    if not isinstance(swept, list) or not swept:
        raise CostModelError(f"the cost model's meta lengths must be a non-empty list of token counts, got {swept!r:.80}")
    return [integer(n, "each of the cost model's meta lengths", CostModelError, maximum=2**40) for n in swept]


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m flexsp.profile.cli``) until ``flexsp profile`` is wired in."""
    parser = argparse.ArgumentParser(prog="flexsp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

