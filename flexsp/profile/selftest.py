"""``flexsp selftest``: prove the executed step on this machine, whatever device it has.

Checks, each printed as a table row and written to a JSON report (exit code 1 when one fails):

1. **kernels**: ``attend`` and ``attend_lse`` with ``backend="auto"`` on the device (bf16 on CUDA, fp32
   on CPU) against a float64 reference on the same packed batch: outputs and gradients.
2. **step**: the degree-1 ``StepExecutor`` step against the plain per-sequence loop
   (``flexsp.runtime.models.plain``) from the same weights: losses and updated weights agree; the
   time ratio (plain / flexsp, medians of interleaved repeats) is printed, not judged.
3. **memory** (CUDA): the step's peak allocated bytes against what the analytic capacity model sets
   aside for that many tokens (states + ``activation_bytes_per_token`` x tokens); skipped on CPU, which
   has no allocator statistics.
4. **host syncs** (CUDA): ``torch.cuda.set_sync_debug_mode("error")`` around a warmed-up step.
5. **all-to-all** on the ranks available: under ``torchrun`` a round trip over the world equals its
   input; with one rank there is nothing to exchange (skipped).

torch is imported inside ``run``: registering the subcommand costs a planner-only install nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from flexsp.errors import FlexSPError

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("selftest", help="check kernels, the degree-1 step, memory and syncs on this device",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens in the step check's batch (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the step check (default 3)")
    p.add_argument("--output", type=Path, default=Path("selftest.json"), help="JSON report (default selftest.json)")
    return p


def _row(name: str, status: str, detail: str, **figures: Any) -> dict:
    return {"check": name, "status": status, "detail": detail, **figures}


def _kernels(torch, device) -> dict:
    from flexsp.runtime.kernels import attend, attend_lse, reference, resolve_backend

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-4
    bounds = (0, 300, 301, 420, 512)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(512, h, 64, generator=g, dtype=torch.float64) for h in (8, 2, 2)]
    dout = torch.randn(512, 8, 64, generator=g, dtype=torch.float64)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    worst = 0.0
    for lse in (False, True):
        dev = [t.to(device=device, dtype=dtype).requires_grad_() for t in base]
        ref = [t.clone().requires_grad_() for t in base]
        if lse:
            out = attend_lse(*dev, cu, cu, max_seqlen_q=300, max_seqlen_k=300, causal=True, bounds_q=bounds,
                             bounds_k=bounds)[0]
            want = reference(*ref, bounds, bounds, causal=True)
        else:
            out = attend(*dev, cu, max_seqlen=300, bounds=bounds)
            want = reference(*ref, bounds)
        grads = torch.autograd.grad((out.double() * dout.to(device)).sum(), dev)
        wants = torch.autograd.grad((want * dout).sum(), ref)
        for got, exp in zip((out, *grads), (want, *wants)):
            scale = exp.abs().max().item() or 1.0
            worst = max(worst, (got.double().cpu() - exp).abs().max().item() / scale)
    kernel = resolve_backend("auto", base[0].to(device=device, dtype=dtype))
    return _row("kernels", PASS if worst <= tol else FAIL,
                f"auto -> {kernel} ({dtype}), max error / max |ref| {worst:.1e} (tolerance {tol:.0e})",
                kernel=kernel, max_relative_error=worst)


def _step(torch, device, tokens: int, repeats: int) -> tuple[dict, Callable[[], None]]:
    import copy

    from flexsp.plan.specs import ModelSpec
    from flexsp.plan.types import Group, MicroBatch, Plan
    from flexsp.runtime.models.plain import plain_loss
    from flexsp.runtime.models.tiny import TinyLM
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor

    spec = ModelSpec(vocab=4096, hidden=256, layers=3, heads=4, kv_heads=2, ffn=688, name="selftest")
    mix = (2048, 1024, 512, 256, 256)
    lengths = [max(2, round(n * tokens / sum(mix))) for n in mix]
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g).to(device) for n in lengths]
    torch.manual_seed(0)
    base = TinyLM(spec).to(device)
    flex, plain = copy.deepcopy(base), copy.deepcopy(base)
    executor = StepExecutor(flex, torch.optim.SGD(flex.parameters(), lr=1e-3), GroupPool())
    plan = Plan(num_gpus=1, predicted_time=0.0,
                micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=tuple(range(len(batch)))),)),))
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def run_flex() -> float:
        return executor.run_plan(plan, batch).loss

    def run_plain() -> float:
        opt.zero_grad(set_to_none=True)
        loss = plain_loss(plain, batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    first = (run_flex(), run_plain())
    drift = max((a - b).abs().max().item() for a, b in zip(flex.parameters(), plain.parameters()))
    times: dict[str, list[float]] = {"flexsp": [], "plain": []}
    for r in range(repeats):
        for name, fn in ((("flexsp", run_flex), ("plain", run_plain)) if r % 2 == 0 else
                         (("plain", run_plain), ("flexsp", run_flex))):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(times["plain"]) / statistics.median(times["flexsp"])
    loss_gap = abs(first[0] - first[1]) / abs(first[1])
    ok = loss_gap < 1e-4 and drift < 1e-4
    row = _row("step", PASS if ok else FAIL,
               f"{sum(lengths)} tokens: loss {first[0]:.6f} vs plain {first[1]:.6f} (rel {loss_gap:.1e}), "
               f"weights differ by {drift:.1e} after a step; plain / flexsp time {ratio:.2f}x",
               tokens=sum(lengths), loss_gap=loss_gap, weight_drift=drift, speed_ratio=ratio,
               flexsp_ms=1000 * statistics.median(times["flexsp"]), plain_ms=1000 * statistics.median(times["plain"]))
    state = {"spec": spec, "tokens": sum(lengths), "run": run_flex, "model": flex}
    return row, state


def _memory(torch, device, state) -> dict:
    if device.type != "cuda":
        return _row("memory", SKIP, "CPU: no allocator statistics to compare with the capacity model")
    from flexsp.plan.analytic import analytic_cost_model  # noqa: F401  (the same formula the planner uses)
    from flexsp.plan.memory import model_state_bytes

    spec, tokens = state["spec"], state["tokens"]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    state["run"]()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    params = sum(p.numel() for p in state["model"].parameters())
    states = model_state_bytes(params, 1, "none")
    act_per_token = 34 * spec.hidden * spec.layers          # analytic_cost_model's bytes per token (recompute off)
    predicted = states + act_per_token * tokens
    return _row("memory", PASS if peak <= predicted else FAIL,
                f"peak {peak / 2**20:.0f} MiB vs capacity model {predicted / 2**20:.0f} MiB "
                f"(states {states / 2**20:.0f} MiB + {act_per_token} B/token x {tokens})",
                peak_bytes=peak, predicted_bytes=predicted)


def _syncs(torch, device, state) -> dict:
    if device.type != "cuda":
        return _row("host syncs", SKIP, "CPU: nothing to wait on")
    try:
        torch.cuda.set_sync_debug_mode("error")
        state["model"].zero_grad(set_to_none=True)
        state["run"]()
    except RuntimeError as exc:
        return _row("host syncs", FAIL, f"a synchronising call inside the step: {str(exc).splitlines()[0]}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return _row("host syncs", PASS, "none inside a warmed-up step (set_sync_debug_mode('error'))")


def _alltoall(torch, device) -> dict:
    import torch.distributed as dist

    from flexsp.runtime.sp.ulysses_comm import head_to_seq, seq_to_head

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _row("all-to-all", SKIP, "one rank available: nothing to exchange (run under torchrun for more)")
    d = dist.get_world_size()
    x = torch.randn(8, 2 * d, 16, device=device, generator=None)
    back = head_to_seq(seq_to_head(x, dist.group.WORLD), dist.group.WORLD)
    ok = torch.equal(back, x)
    return _row("all-to-all", PASS if ok else FAIL, f"round trip over {d} ranks {'exact' if ok else 'WRONG'}")


def run(args: argparse.Namespace) -> int:
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise FlexSPError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise FlexSPError("--device cuda: no CUDA device is available here")
    if args.tokens < 16 or args.repeats < 1:
        raise FlexSPError("--tokens must be >= 16 and --repeats >= 1")
    device = torch.device(name)
    rows = [_kernels(torch, device)]
    step_row, state = _step(torch, device, args.tokens, args.repeats)
    rows += [step_row, _memory(torch, device, state), _syncs(torch, device, state), _alltoall(torch, device)]
    label = torch.cuda.get_device_name(device) if name == "cuda" else f"CPU ({os.cpu_count()} cores)"
    load = os.getloadavg()
    print(f"flexsp selftest on {label}, torch {torch.__version__}, load average {load[0]:.1f}")
    width = max(len(r["check"]) for r in rows)
    for r in rows:
        print(f"  {r['check']:<{width}}  {r['status']:<4}  {r['detail']}")
    report = {"device": label, "torch": torch.__version__, "load_average": load, "checks": rows}
    try:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as exc:
        raise FlexSPError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output}")
    return 1 if any(r["status"] == FAIL for r in rows) else 0
