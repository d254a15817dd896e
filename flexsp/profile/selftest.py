"""``flexsp selftest``: prove, on this machine, the path training runs.

Checks, each printed as a table row and written to a JSON report (exit code 1 when one fails):

1. **kernels**: ``attend`` and ``attend_lse`` with ``backend="auto"`` (bf16 on CUDA, fp32 on CPU) at the
   model's head layout against a float64 reference on the same packed batch, outputs and q/k/v
   gradients, *including padding rows* past ``cu_seqlens[-1]``: their output and gradients must be
   exactly 0 (a kernel's backward may leave anything in rows it never visits; training at degree > 1
   pads every group). On CUDA the allocator is poisoned first (``runtime.poison``: a large NaN block
   freed just before), so an unwritten row shows every time; the row names the kernels the profiler saw
   run, forward and backward (``runtime.kernels.ran``), beside the one the rule asked for.
2. **step**: the degree-1 ``StepExecutor`` step against the plain per-sequence loop
   (``flexsp.runtime.models.plain``, or the transformers model itself with ``--hf-config``) under the same
   autocast, from the same weights: losses and SGD updates agree within the compute dtype's tolerance;
   the time ratio (plain / flexsp, medians of interleaved repeats) and both TFLOP/s are printed.
3. **memory** (CUDA): activations against activations, states apart: what each micro-batch's forward
   leaves allocated, less the states a forward makes (``Budget.forward_states``), against the capacity
   model's ``activation_bytes_per_token`` x its tokens, within 15% (an activation regression fails it);
   and the step's peak allocated bytes during forward and backward (AdamW, so both sides count the same
   states) never above the capacity model's whole budget (``selftest_model.budget``: states +
   activations) by more than the workspace the capacity formula leaves (``1 - usable_memory``).
4. **host syncs** (CUDA): ``torch.cuda.set_sync_debug_mode("error")`` from the step's packing to the
   end of its last backward; a synchronising call is reported with its innermost flexsp call site. The
   LM-head library's own syncs (liger-kernel's ``.item()`` and ``torch.equal``) are outside the check
   (``fused_loss.library_syncs_allowed``); FlexSP's code around them is not.
5. **all-to-all** on the ranks available: under ``torchrun`` each rank runs checks 1-4 on its own device
   (``LOCAL_RANK``) as a world of one, then joins the launch's world and a round trip over it must equal its
   input; rank 0 writes ``--output``, rank r ``<stem>.rank<r><suffix>`` beside it. With one rank there is
   nothing to exchange (skipped).

The model (``selftest_model``): on CUDA a Llama-3-8B layer shape with 2 layers in bf16 through
``shard_model`` (the README's loop), the vocabulary cut only where the device needs it; on CPU a small
fp32 model that runs in seconds (CI). ``--shape`` and ``--hf-config`` choose another.
torch is imported inside ``run``: registering the subcommand costs a planner-only install nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

from flexsp.errors import FlexSPError
from flexsp.plan.specs import GPUSpec
from flexsp.profile import selftest_model as sm

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
MEMORY_TOLERANCE = 0.15      # |peak - capacity model| / capacity model
# (loss, update) relative tolerances: bf16 compute (different kernels and chunking round differently), fp32
STEP_TOLERANCE = {True: (5e-3, 5e-2), False: (1e-4, 1e-3)}
KERNEL_TOLERANCE = {True: 3e-2, False: 2e-4}
SGD_LR = 0.1


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("selftest", help="check kernels, the degree-1 step, memory and syncs on this device",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--shape", default=None,
                   help=f"model shape: a registered model name, field=value pairs, or a name then pairs "
                        f"(default CUDA {sm.CUDA_SHAPE!r}, CPU {sm.CPU_SHAPE!r}; fields: hidden, layers, heads, "
                        f"kv_heads, ffn, vocab)")
    p.add_argument("--hf-config", default=None, metavar="DIR|ARCH",
                   help="run your transformers model (random init from its config.json, behind the HF adapter) "
                        "instead of TinyLM; --shape layers=N sets its layers (default 2)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens in the step's batch (default CUDA {sm.CUDA_TOKENS}, CPU {sm.CPU_TOKENS})")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the step check (default 3)")
    p.add_argument("--output", type=Path, default=Path("selftest.json"), help="JSON report (default selftest.json)")
    return p


def _row(name: str, status: str, detail: str, **figures: Any) -> dict:
    return {"check": name, "status": status, "detail": detail, **figures}


# --- 1. kernels ----------------------------------------------------------------------------------------
def kernel_batch(spec, half: bool) -> tuple[tuple[int, ...], int]:
    """Sequence bounds and the padded row count of the kernel check: a long, a one-token, a middle
    sequence, then padding rows (a multiple of 64 past the last bound, as ``pack`` pads for a degree)."""
    bounds = (0, 1500, 1501, 2600) if half else (0, 300, 301, 420)
    return bounds, bounds[-1] + (472 if half else 92)


def _kernels(torch, device, spec) -> dict:
    from flexsp.runtime.kernels import attend, attend_lse, ran, reference, resolve_backend
    from flexsp.runtime.poison import poison_allocator

    half = device.type == "cuda"
    dtype = torch.bfloat16 if half else torch.float32
    bounds, rows = kernel_batch(spec, half)
    real, longest = bounds[-1], max(b - a for a, b in zip(bounds, bounds[1:]))
    g = torch.Generator().manual_seed(0)
    shapes = ((spec.heads, spec.head_size), (spec.kv_heads, spec.head_size), (spec.kv_heads, spec.head_size))
    base = [torch.randn(rows, h, d, generator=g, dtype=torch.float64).to(device) for h, d in shapes]
    dout = torch.randn(rows, spec.heads, spec.head_size, generator=g, dtype=torch.float64).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32).to(device)
    worst, leak = 0.0, 0.0
    seen: dict[str, dict[str, list[str]]] = {}
    for lse in (False, True):
        dev = [t.to(dtype).requires_grad_() for t in base]
        ref = [t.clone().requires_grad_() for t in base]   # float64 on the device: the reference is exact
        poison_allocator(device)                           # unwritten rows read NaN, not a lucky zero
        if lse:
            out, fwd = ran.kernels_in(lambda: attend_lse(*dev, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                                         causal=True, bounds_q=bounds, bounds_k=bounds)[0])
            want = reference(*ref, bounds, bounds, causal=True)
        else:
            out, fwd = ran.kernels_in(lambda: attend(*dev, cu, max_seqlen=longest, bounds=bounds))
            want = reference(*ref, bounds)
        grads, bwd = ran.kernels_in(lambda: torch.autograd.grad((out.double() * dout).sum(), dev))
        seen["attend_lse" if lse else "attend"] = {"forward": fwd["forward"], "backward": bwd["backward"]}
        wants = torch.autograd.grad((want * dout).sum(), ref)
        for got, exp in zip((out, *grads), (want, *wants)):
            scale = exp[:real].abs().max().item() or 1.0
            worst = max(worst, (got[:real].double() - exp[:real]).abs().max().item() / scale)
            leak = max(leak, got[real:].double().abs().max().nan_to_num(float("inf")).item())
    kernel = resolve_backend("auto", base[0].to(dtype), bounds)
    tol = KERNEL_TOLERANCE[half]
    ok = worst <= tol and leak == 0.0
    ran_text = "; ".join(f"{name} {ran.describe(k)}" for name, k in seen.items())
    return _row("kernels", PASS if ok else FAIL,
                f"auto -> {kernel}, ran: {ran_text} ({str(dtype).replace('torch.', '')}, {spec.heads}/{spec.kv_heads} "
                f"heads x {spec.head_size}), max error / max |ref| {worst:.1e} (tolerance {tol:.0e}); {rows - real} "
                f"padding rows{' (allocator poisoned with NaN)' if half else ''}: max |output or q/k/v grad| "
                f"{leak:.1e} (must be exactly 0)",
                kernel=kernel, kernels_ran=seen,
                max_relative_error=worst, padding_max_abs=leak)


# --- 2. step ----------------------------------------------------------------------------------------------
def batch_lengths(tokens: int) -> list[int]:
    return [max(2, round(n * tokens / sum(sm.MIX))) for n in sm.MIX]


def _max_rel(deltas_a, deltas_b) -> float:
    scale = max(b.abs().max().item() for b in deltas_b) or 1.0
    return max((a - b).abs().max().item() for a, b in zip(deltas_a, deltas_b)) / scale


def _step(torch, device, built: "sm.Built", batch, repeats: int) -> tuple[dict, Callable[[], None]]:
    from flexsp.plan.types import Group, MicroBatch, Plan
    from flexsp.runtime.config import TrainConfig
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor

    half = device.type == "cuda"
    config = TrainConfig(param_dtype=torch.bfloat16 if half else None)
    flex, plain = built.flex, built.plain
    executor = StepExecutor(flex, torch.optim.SGD(flex.parameters(), lr=SGD_LR), GroupPool(), config=config)
    plan = Plan(num_gpus=1, predicted_time=0.0,
                micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=tuple(range(len(batch)))),)),))
    opt = torch.optim.SGD(plain.parameters(), lr=SGD_LR)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if half else nullcontext
    sync = (lambda: torch.cuda.synchronize(device)) if half else (lambda: None)

    def run_flex() -> float:
        return executor.run_plan(plan, batch).loss

    def run_plain() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast():   # the same autocast the executor applies to the prepared model
            loss = built.plain_loss(plain, batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    first = (run_flex(), run_plain())
    with torch.no_grad():
        start = list(built.base.parameters())
        flex_update = [a - s for a, s in zip(flex.parameters(), start)]
        plain_update = [b - s for b, s in zip(plain.parameters(), start)]
        update_gap = _max_rel(flex_update, plain_update)
        del flex_update, plain_update, start
    times: dict[str, list[float]] = {"flexsp": [], "plain": []}
    for r in range(repeats):
        for name, fn in ((("flexsp", run_flex), ("plain", run_plain)) if r % 2 == 0 else
                         (("plain", run_plain), ("flexsp", run_flex))):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    lengths = [int(s.numel()) for s in batch]
    flops = built.spec.training_flops(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["plain"] / med["flexsp"]
    loss_gap = abs(first[0] - first[1]) / abs(first[1])
    loss_tol, update_tol = STEP_TOLERANCE[half]
    ok = loss_gap <= loss_tol and update_gap <= update_tol
    row = _row("step", PASS if ok else FAIL,
               f"{sum(lengths)} tokens ({built.kind}, {'bf16 autocast' if half else 'fp32'}): loss {first[0]:.6f} vs "
               f"plain {first[1]:.6f} (rel {loss_gap:.1e}, tolerance {loss_tol:.0e}); SGD updates differ by "
               f"{update_gap:.1e} of the largest (tolerance {update_tol:.0e}); plain / flexsp time {ratio:.2f}x "
               f"(measured: flexsp {flops / med['flexsp'] / 1e12:.3g} TFLOP/s, plain "
               f"{flops / med['plain'] / 1e12:.3g} TFLOP/s)",
               tokens=sum(lengths), loss_gap=loss_gap, update_gap=update_gap, speed_ratio=ratio,
               flexsp_ms=1000 * med["flexsp"], plain_ms=1000 * med["plain"],
               flexsp_tflops=flops / med["flexsp"] / 1e12, plain_tflops=flops / med["plain"] / 1e12)
    executor.close()
    return row, plan


# --- 3./4. memory and host syncs (CUDA): one AdamW executor, a probe around its forward and backward --------
def _window(on_open: Callable[[], None], on_close: Callable[[], None]):
    """A ``StepProbe`` that brackets a step's packing + forward + backward (not the loss read or the
    optimizer step): ``on_open`` at ``step_begin``, ``on_close`` after the last micro-batch's backward.
    The callbacks are attributes, so one executor can measure memory, then syncs."""
    from flexsp.runtime.probe import StepProbe

    class Window(StepProbe):
        def __init__(self) -> None:
            self.on_open, self.on_close, self.last = on_open, on_close, -1
            self.on_forward_begin = self.on_forward_end = lambda index, tokens=0: None

        def step_begin(self, plan, source) -> None:
            self.last = len(plan.micro_batches) - 1
            self.on_open()

        def micro_batch_begin(self, index: int, group, real_tokens: int) -> None:
            self.on_forward_begin(index, real_tokens)

        def forward_end(self, index: int) -> None:
            self.on_forward_end(index)

        def micro_batch_end(self, index: int) -> None:
            if index == self.last:
                self.on_close()

    return Window()


def call_site(exc: BaseException) -> str:
    """The innermost flexsp frame of ``exc``'s traceback (outside this selftest) as ``path:line in fn``."""
    marker = os.sep + "flexsp" + os.sep
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if marker in f.filename and not os.path.basename(f.filename).startswith("selftest")]
    if not frames:
        return "outside flexsp"
    f = frames[-1]
    path = f.filename[f.filename.rindex(marker) + 1:]
    return f"{path}:{f.lineno} in {f.name}" + (f" ({f.line.strip()})" if f.line else "")


def _head_grad_bytes() -> int:
    """Bytes per element of the LM head's gradient the selftest's bf16 CUDA step makes in its forward: liger-kernel
    (``fused_loss``'s choice wherever it is installed) returns it in bf16; FlexSP's own loss keeps fp32."""
    from flexsp.runtime.models.fused_loss import library_function
    return 2 if library_function() is not None else 4


def memory_row(spec, tokens: int, marks: dict, forwards: dict, workspace: float, head_grad_bytes: int = 4) -> dict:
    """The memory check's row (module docstring, check 3) from the allocator figures: ``marks`` (``other``:
    allocations at the step's start that are not model states; ``peak``), ``forwards`` (micro-batch ->
    [real tokens, allocated before its forward, after it]) and the workspace the capacity formula leaves;
    ``head_grad_bytes``: as ``selftest_model.budget`` takes it (the loss kernel that ran)."""
    need = sm.budget(spec, tokens, half=True, head_grad_bytes=head_grad_bytes)
    peak = marks["peak"] - marks["other"]
    # the micro-batch with the most tokens: its forward's growth less the states a forward makes
    mb_tokens, before, after = max(forwards.values(), key=lambda f: f[0]) if forwards else (0, 0, 0)
    measured = after - before - need.forward_states
    predicted = need.activation_per_token * mb_tokens
    rel = (measured - predicted) / predicted if predicted else float("inf")
    ok = abs(rel) <= MEMORY_TOLERANCE and peak <= need.total + workspace
    return _row("memory", PASS if ok else FAIL,
                f"activations {measured / 2**20:.0f} MiB after the forward vs capacity model {predicted / 2**20:.0f} "
                f"MiB ({need.activation_per_token:.0f} B/token x {mb_tokens}; {rel:+.1%}, tolerance "
                f"{MEMORY_TOLERANCE:.0%}; the forward's own states, {need.forward_states / 2**20:.0f} MiB of bf16 "
                f"layer weights and the head's {'fp32' if head_grad_bytes == 4 else 'bf16'} gradient, apart); peak {peak / 2**20:.0f} MiB in "
                f"forward+backward vs the whole budget {need.total / 2**20:.0f} MiB, above it by at most the "
                f"{1 - GPUSpec.usable_memory:.0%} workspace ({workspace / 2**20:.0f} MiB): {need.describe()}; "
                f"measured, other allocations ({marks['other'] / 2**20:.0f} MiB) excluded",
                peak_bytes=peak, predicted_bytes=need.total, relative_error=rel, workspace_bytes=workspace,
                activation_bytes=measured, predicted_activation_bytes=predicted,
                forward_state_bytes=need.forward_states, predicted_state_bytes=need.states.total)


def _resident_bytes(model, optimizer) -> int:
    """Bytes of the states the capacity model counts that exist now: parameters, gradients, optimizer states."""
    params = list(model.parameters())
    device = params[0].device
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [t for s in optimizer.state.values() for t in s.values()   # moments, not AdamW's scalar step count
                if getattr(t, "device", None) == device and t.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def _memory_and_syncs(torch, device, built: "sm.Built", plan, batch, tokens: int) -> list[dict]:
    from flexsp.runtime.config import TrainConfig
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor

    model = built.flex
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    marks: dict[str, int] = {}

    def open_memory() -> None:
        marks["other"] = torch.cuda.memory_allocated(device) - _resident_bytes(model, optimizer)
        torch.cuda.reset_peak_memory_stats(device)

    def close_memory() -> None:
        marks["peak"] = torch.cuda.max_memory_allocated(device)

    forwards: dict[int, list] = {}    # micro-batch -> [tokens, allocated before its forward, after it]

    def forward_begin(index: int, real_tokens: int = 0) -> None:
        forwards[index] = [real_tokens, torch.cuda.memory_allocated(device), None]

    def forward_end(index: int, tokens: int = 0) -> None:
        forwards[index][2] = torch.cuda.memory_allocated(device)

    probe = _window(lambda: None, lambda: None)
    executor = StepExecutor(model, optimizer, GroupPool(), config=TrainConfig(param_dtype=torch.bfloat16),
                            probe=probe, failure_name="selftest-memory")
    executor.run_plan(plan, batch)                  # warm: AdamW's moments exist from here on
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    probe.on_open, probe.on_close = open_memory, close_memory
    probe.on_forward_begin, probe.on_forward_end = forward_begin, forward_end
    executor.run_plan(plan, batch)
    torch.cuda.synchronize(device)
    probe.on_forward_begin = probe.on_forward_end = lambda index, tokens=0: None
    memory = memory_row(built.spec, tokens, marks, forwards,
                        (1 - GPUSpec.usable_memory) * torch.cuda.get_device_properties(device).total_memory,
                        head_grad_bytes=_head_grad_bytes())

    def arm() -> None:
        torch.cuda.set_sync_debug_mode("error")

    def disarm() -> None:
        torch.cuda.set_sync_debug_mode(0)

    from flexsp.runtime.models.fused_loss import library_syncs_allowed

    probe.on_open, probe.on_close = arm, disarm
    try:
        with library_syncs_allowed():
            executor.run_plan(plan, batch)
        syncs = _row("host syncs", PASS, "none in FlexSP's code from the step's packing to the end of its backward "
                                         "(set_sync_debug_mode('error'), warmed-up step; the LM-head library's own "
                                         "syncs excluded)")
    except RuntimeError as exc:
        syncs = _row("host syncs", FAIL, f"a synchronising call inside the step at {call_site(exc)}: "
                                         f"{str(exc).splitlines()[0]}", site=call_site(exc))
    finally:
        disarm()
        executor.close()
    return [memory, syncs]


# --- 5. all-to-all ------------------------------------------------------------------------------------------
def launched_ranks() -> tuple[int, int, int]:
    """``(rank, local rank, world size)`` of a ``torchrun`` launch (``(0, 0, 1)`` without one: a shell that only
    exports ``WORLD_SIZE``, as batch scripts do, is no launch to join)."""
    env = os.environ
    if not all(key in env for key in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return 0, 0, 1
    try:
        return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))
    except ValueError:
        raise FlexSPError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (a torchrun launch)") from None


def _alltoall(torch, device) -> dict:
    """The round trip over the launch's world: joined here, after the per-rank checks (each rank a world of one
    on its own device), and left again."""
    import torch.distributed as dist

    from flexsp.runtime.sp.ulysses_comm import head_to_seq, seq_to_head

    _, _, world = launched_ranks()
    if world == 1:
        return _row("all-to-all", SKIP, "one rank available: nothing to exchange (run under torchrun for more)")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    try:
        x = torch.randn(8, 2 * world, 16, device=device)
        back = head_to_seq(seq_to_head(x, dist.group.WORLD), dist.group.WORLD)
        ok = torch.equal(back, x)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return _row("all-to-all", PASS if ok else FAIL, f"round trip over {world} ranks {'exact' if ok else 'WRONG'}")


# --- the run ------------------------------------------------------------------------------------------------
@contextmanager
def world_of_one():
    """A one-process gloo group for ``shard_model`` when no process group exists (removed afterwards)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            raise sm.SelftestError("the step checks run at degree 1 on each process, as a world of one: run flexsp "
                                   "selftest before the process group is started (under torchrun it joins the "
                                   "launch's world itself, for the all-to-all check)")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_model(torch, device, shape: str | None, hf_config: str | None, tokens: int | None,
               memory_bytes: float | None) -> dict[str, Any]:
    """Everything decided before a tensor is made: the shape (vocabulary cut to the device), the batch,
    the compute dtype, the HF config if any, the capacity model's budget. Runs under ``FakeTensorMode``."""
    half = device.type == "cuda"
    tokens = tokens if tokens is not None else (sm.CUDA_TOKENS if half else sm.CPU_TOKENS)
    if tokens < 16:
        raise sm.SelftestError(f"--tokens must be >= 16, got {tokens}")
    lengths = batch_lengths(tokens)
    cfg = None
    if hf_config is not None:
        from flexsp.plan.specs import spec_from_hf_config
        _, fields = sm.parse_shape(shape or "layers=2", hf=True)
        try:
            cfg = sm.hf_config_for(hf_config, fields.get("layers", 2))
        except ImportError as exc:
            raise sm.SelftestError(f"--hf-config needs transformers (pip install 'flexsp[hf]'): {exc}") from None
        spec = spec_from_hf_config(cfg)
    else:
        spec = sm.resolve_spec(shape or (sm.CUDA_SHAPE if half else sm.CPU_SHAPE))
    note = ""
    if memory_bytes is not None:
        spec, note = sm.fit_vocab(spec, sum(lengths), max(lengths), half, memory_bytes)
        if note and cfg is not None:
            cfg = sm.hf_config_for(hf_config, spec.layers, spec.vocab)
    return {"spec": spec, "hf": cfg, "lengths": lengths, "half": half, "vocab_note": note,
            "budget": sm.budget(spec, sum(lengths), half=half)}


def run(args: argparse.Namespace) -> int:
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise FlexSPError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise FlexSPError("--device cuda: no CUDA device is available here")
    if args.repeats < 1:
        raise FlexSPError(f"--repeats must be >= 1, got {args.repeats}")
    rank, local, world = launched_ranks()
    # under torchrun every rank reports its own device: rank 0 to --output, rank r beside it
    output = args.output if rank == 0 else args.output.with_name(f"{args.output.stem}.rank{rank}{args.output.suffix}")
    from flexsp.inputs import writable_file
    writable_file(output, "selftest report", FlexSPError)   # before the checks, not after them
    if name == "cuda":   # under torchrun each rank checks its own GPU (the node's local rank), not all of them cuda:0
        if world > 1:
            if local >= torch.cuda.device_count():
                raise FlexSPError(f"LOCAL_RANK {local} but {torch.cuda.device_count()} CUDA devices are visible")
            torch.cuda.set_device(local)
        device = torch.device(name, torch.cuda.current_device())
    else:
        device = torch.device(name)
    from flexsp.profile.memory import device_memory_bytes
    memory = device_memory_bytes(device)        # the host's RAM on the CPU: a shape it cannot hold is refused
    setup = plan_model(torch, device, args.shape, args.hf_config, args.tokens, memory)
    spec, lengths = setup["spec"], setup["lengths"]
    rows = [_kernels(torch, device, spec)]
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g).to(device) for n in lengths]
    with world_of_one():
        built = sm.build(torch, spec, device, half=setup["half"], hf_config=setup["hf"], max_seqlen=max(lengths))
        step_row, plan = _step(torch, device, built, batch, args.repeats)
        rows.append(step_row)
        built = sm.Built(flex=built.flex, plain=None, base=None, plain_loss=built.plain_loss, spec=spec,
                         kind=built.kind)   # free the plain loop's copy and the start weights before measuring
        if name == "cuda":
            torch.cuda.empty_cache()
            rows += _memory_and_syncs(torch, device, built, plan, batch, sum(lengths))
        else:
            rows += [_row("memory", SKIP, "CPU: no allocator statistics to compare with the capacity model"),
                     _row("host syncs", SKIP, "CPU: nothing to wait on")]
    rows.append(_alltoall(torch, device))
    label = torch.cuda.get_device_name(device) if name == "cuda" else f"CPU ({os.cpu_count()} cores)"
    load = os.getloadavg()
    print(f"flexsp selftest on {label}, torch {torch.__version__}, load average {load[0]:.1f}")
    print(f"  model: {spec.name} {spec.layers} layers, hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads}, ffn "
          f"{spec.ffn}, vocab {spec.vocab} ({spec.params / 1e6:,.1f} M params); batch {lengths}"
          + (f"; {setup['vocab_note']}" if setup["vocab_note"] else ""))
    width = max(len(r["check"]) for r in rows)
    for r in rows:
        print(f"  {r['check']:<{width}}  {r['status']:<4}  {r['detail']}")
    report = {"device": label, "torch": torch.__version__, "load_average": load, "model": spec.shape(),
              "params": spec.params, "batch": lengths, "vocab_note": setup["vocab_note"], "checks": rows}
    try:
        output.write_text(json.dumps({**report, "rank": rank, "world_size": world}, indent=2) + "\n")
    except OSError as exc:
        raise FlexSPError(f"cannot write {output}: {exc.strerror or exc}") from None
    print(f"wrote {output}")
    return 1 if any(r["status"] == FAIL for r in rows) else 0
