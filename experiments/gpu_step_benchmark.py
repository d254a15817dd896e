"""GPU step benchmark (issue 36): FlexSP's step against the plain loops at the Llama-3-8B layer shape.

Llama-3-8B layers (hidden 4096, 32 q / 8 kv heads, ffn 14,336, vocab 128,256), 2 of them, bf16, one batch of
33,792 tokens [16K, 8K, 4K, 2K, 1K, 1K, 512, 512]; same weights, same batch; medians of interleaved rounds
after a warm-up step whose losses are compared:

* ``executor``: ``StepExecutor.run_plan`` after ``shard_model`` (world 1, bf16 autocast), TinyLM, AdamW;
* ``plain loop``: TinyLM one sequence at a time under the same autocast (``flexsp.runtime.models.plain``), AdamW;
* ``flexsp hf``: ``flexsp.hf.prepare_model(model).shard_loss`` on the packed batch (bf16 weights, forward +
  backward);
* ``hf each``: the same transformers ``LlamaForCausalLM`` (built from a config, no download) called natively
  once per sequence, SDPA attention, ``F.cross_entropy`` on its logits (forward + backward).

Then ``flexsp hf`` against ``hf each`` at 64 x 512 and 8 x 4K tokens. Peak memory: the allocator's peak over
one step above what was allocated at its start (weights and optimizer states excluded). MFU: (6 N tokens +
causal attention FLOPs) / step time / 989 TFLOP/s (H100/H200 dense bf16), N = the layers' and the LM head's
matmul weights. Targets (issue 36): executor >= 1.15x the plain loop; flexsp hf >= 1.15x hf each; its peak
memory <= 0.8x hf each's; >= 52% MFU (executor and flexsp hf); 64 x 512: >= 1.9x; 8 x 4K: >= 1.1x. Each is
printed as met or MISSED.

The executor-vs-plain group sizes itself to the device (``fit_tiny``): both contenders hold a full model with
fp32 AdamW states (16 bytes a parameter each) and the plain loop keeps every sequence's bf16 logits and fp32
log-softmax for backward, about 91 GB at 33,792 tokens - past an 80 GB H100. Its tokens are halved (every
length, same mix) until the estimate fits 80% of the device's memory; the size it ran is printed and saved
(``size``). The HF groups carry no optimizer states and run at their named shapes. Which attention kernels
each contender ran, forward and backward, is recorded from one profiled step (``kernels``).

Only a CUDA run measures these: it writes ``experiments/results/gpu_step.json`` (after each group, so a run cut
short leaves what it measured). A CPU run (``--quick``: a tiny shape, fp32, one round) checks the machinery,
says it measured nothing about GPUs and writes only to ``--output`` or a temporary folder. A contender that
runs out of memory is reported as such and the others go on; ``--budget-s`` bounds the rounds.

    python experiments/gpu_step_benchmark.py                     # on a GPU; --budget-s bounds the rounds
    python experiments/gpu_step_benchmark.py --quick --output /tmp/gpu_step.json   # CI, on CPU
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import free_port  # noqa: E402
from step_benchmark import Contender, HFContender, HostMeter, hf_model, measure  # noqa: E402

from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.kernels import ran  # noqa: E402
from flexsp.runtime.fsdp import shard_model  # noqa: E402
from flexsp.runtime.models.fused_loss import KERNELS, library_refusal  # noqa: E402
from flexsp.runtime.models.plain import plain_loss  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_step.json"
SPEC = ModelSpec(vocab=128256, hidden=4096, layers=2, heads=32, kv_heads=8, ffn=14336, rope_theta=500000.0,
                 name="llama3-8b-2-layers")
QUICK_SPEC = ModelSpec(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, name="quick")
MIXED = (16384, 8192, 4096, 2048, 1024, 1024, 512, 512)
SHORT, LONG = (512,) * 64, (4096,) * 8
PEAK_FLOPS = 989e12          # H100 / H200 SXM dense bf16
TARGETS = {"executor_vs_plain": 1.15, "hf_vs_native": 1.15, "hf_memory_vs_native": 0.8, "mfu": 0.52,
           "short_vs_native": 1.9, "long_vs_native": 1.1}


FIT_SHARE = 0.8             # of the device memory the tiny group's estimate may take
STATE_BYTES = 16            # fp32 master + grad + AdamW moments, per parameter, per model
LOGIT_BYTES = 2 + 4 + 4     # plain loop: bf16 logits and fp32 log-softmax kept, fp32 gradient of the longest
ACTIVATION_BYTES = 34       # per token, per hidden unit, per layer (bf16): the capacity model's figure


def tiny_peak_bytes(spec: ModelSpec, lengths: tuple[int, ...]) -> float:
    """The tiny group's estimated peak: two models' states, the plain loop's logits and layer activations."""
    tokens = sum(lengths)
    return (2 * STATE_BYTES * spec.params + (2 + 4) * tokens * spec.vocab + 4 * max(lengths) * spec.vocab
            + ACTIVATION_BYTES * 2 * spec.hidden * spec.layers * tokens)


def fit_tiny(spec: ModelSpec, lengths: tuple[int, ...], memory: float | None) -> tuple[tuple[int, ...], str]:
    """``lengths`` halved until ``tiny_peak_bytes`` fits ``FIT_SHARE`` of ``memory`` (None: as given), and a
    line saying which size runs."""
    if memory is None:
        return lengths, f"{sum(lengths):,} tokens (no device memory to fit)"
    cut = 1
    while tiny_peak_bytes(spec, tuple(max(2, n // cut) for n in lengths)) > FIT_SHARE * memory and cut < 64:
        cut *= 2
    fitted = tuple(max(2, n // cut) for n in lengths)
    est = tiny_peak_bytes(spec, fitted) / 2**30
    what = "full size" if cut == 1 else f"tokens / {cut} to fit"
    return fitted, (f"{what}: {sum(fitted):,} tokens, {spec.layers} layers (estimated peak {est:.0f} GiB of "
                    f"{memory / 2**30:.0f} GiB)")


def kernels_of(contenders: dict) -> dict:
    """Each contender's attention kernels, forward and backward, from one profiled step."""
    out = {}
    for name, c in contenders.items():
        if c.failed:
            continue
        try:
            _, out[name] = ran.kernels_in(c.run)
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    return out


class CudaMeter(HostMeter):
    """Synchronised wall time (CPU time of the host thread beside it) and the allocator's peak over one step
    above its allocation at the step's start; an out-of-memory step fails its contender only."""

    recoverable = (torch.cuda.OutOfMemoryError,)

    def time(self, run: Callable[[], float]) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        loss = run()                      # returns a float: the step's own host sync
        torch.cuda.synchronize()
        return loss, time.perf_counter() - start, time.process_time() - cpu

    def peak_mib(self, run: Callable[[], float]) -> float:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20


class TinyContender(Contender):
    """``executor`` (the base's "flexsp": run_plan after shard_model, autocast from its param dtype) or the
    plain loop under the same autocast; the batch lives on the model's device."""

    def __init__(self, name: str, model: TinyLM, batch: list[torch.Tensor], autocast: torch.dtype | None,
                 backend: str) -> None:
        super().__init__("flexsp" if name == "executor" else name, model, batch)
        self.label, self.autocast = name, autocast
        if name == "executor" and backend != "auto":
            self.executor = StepExecutor(model, self.optimizer, GroupPool(), backend=backend)

    def run(self) -> float:
        if self.name == "flexsp":
            return super().run()
        self.optimizer.zero_grad(set_to_none=True)
        device = self.batch[0].device.type
        with torch.autocast(device, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            value = plain_loss(self.model, self.batch)
        value.backward()
        self.optimizer.step()
        return float(value.detach())


class HFPass(HFContender):
    """A transformers model's forward + backward, natively per sequence (``hf each``) or through the adapter
    (``flexsp hf``); no optimizer (the issue's HF rows)."""

    def run(self) -> float:
        self.model.zero_grad(set_to_none=True)
        value = self.loss()
        value.backward()
        return float(value.detach())

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.model.zero_grad(set_to_none=True)


def batch_of(lengths: tuple[int, ...], vocab: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).to(device) for n in lengths]


def summary(c: Contender, flops: float) -> dict:
    """One contender's figures: median wall seconds, TFLOP/s, MFU, peak MiB, first loss; or why it failed."""
    out = {"failed": c.failed, "rounds": len(c.seconds), "first_loss": c.losses[0] if c.losses else None}
    if c.seconds:
        sec = median(c.seconds)
        out.update(ms=1e3 * sec, tflops=flops / sec / 1e12, mfu=flops / sec / PEAK_FLOPS, peak_mib=c.peak_mib)
    return out


def tiny_group(spec: ModelSpec, batch: list[torch.Tensor], args, deadline: float, meter: HostMeter) -> dict:
    """executor vs plain loop on ``batch`` (their own copies of one set of weights)."""
    device = batch[0].device
    torch.manual_seed(0)
    with device:
        base = TinyLM(spec, loss_kernel=args.loss_kernel)
    param_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    executor_model = shard_model(copy.deepcopy(base), param_dtype=param_dtype)   # world 1: autocast, no FSDP
    contenders = [TinyContender("executor", executor_model, batch, param_dtype, args.backend),
                  TinyContender("plain loop", base, batch, param_dtype, args.backend)]
    first = measure(contenders, args.rounds, meter, deadline)
    return {"first_losses": first, "contenders": {c.label: c for c in contenders}}


def hf_group(native: torch.nn.Module, batch: list[torch.Tensor], args, deadline: float, meter: HostMeter) -> dict:
    """flexsp hf vs hf each on ``batch`` (their own copies of ``native``'s weights)."""
    from flexsp.hf import prepare_model
    adapter = prepare_model(copy.deepcopy(native), loss_kernel=args.loss_kernel)
    contenders = [HFPass("flexsp hf", adapter, batch, backend=args.backend), HFPass("hf each", native, batch)]
    first = measure(contenders, args.rounds, meter, deadline)
    return {"first_losses": first, "contenders": {c.name: c for c in contenders}}


def ratio(summaries: dict, fast: str, slow: str) -> float:
    """``slow``'s median time over ``fast``'s (NaN where either did not run)."""
    a, b = summaries.get(fast, {}).get("ms"), summaries.get(slow, {}).get("ms")
    return b / a if a and b else float("nan")


def describe(lengths: list[int]) -> str:
    """``64 x 512`` for equal lengths, else the total and the lengths."""
    if len(set(lengths)) == 1:
        return f"{len(lengths)} x {lengths[0]}"
    return f"{sum(lengths):,} tokens: {', '.join(map(str, lengths))}"


def verdicts(groups: dict) -> list[tuple[str, float, str, float, bool]]:
    """``(what, value, comparison, target, met)`` for every target of the groups that were asked for; a
    group or contender that did not run gives NaN, which is never met."""
    out = []

    def add(what, value, target, higher=True):
        met = (value >= target) if higher else (value <= target)
        out.append((what, value, ">=" if higher else "<=", target, bool(met) and not math.isnan(value)))

    def summaries(key):
        return groups[key].get("summary", {})
    if "tiny mixed" in groups:
        s = summaries("tiny mixed")
        add(f"executor vs plain loop ({describe(groups['tiny mixed']['lengths'])}), speed", ratio(s, "executor", "plain loop"),
            TARGETS["executor_vs_plain"])
        add("executor MFU (mixed)", s.get("executor", {}).get("mfu", float("nan")), TARGETS["mfu"])
    if "hf mixed" in groups:
        s = summaries("hf mixed")
        add("flexsp hf vs hf each (mixed), speed", ratio(s, "flexsp hf", "hf each"), TARGETS["hf_vs_native"])
        mine, theirs = (s.get(n, {}).get("peak_mib", float("nan")) for n in ("flexsp hf", "hf each"))
        add("flexsp hf peak memory / hf each's (mixed)", mine / theirs if theirs > 0 else float("nan"),
            TARGETS["hf_memory_vs_native"], higher=False)
        add("flexsp hf MFU (mixed)", s.get("flexsp hf", {}).get("mfu", float("nan")), TARGETS["mfu"])
    for key, target in (("hf short", "short_vs_native"), ("hf long", "long_vs_native")):
        if key in groups:
            add(f"flexsp hf vs hf each ({describe(groups[key]['lengths'])}), speed",
                ratio(summaries(key), "flexsp hf", "hf each"), TARGETS[target])
    return out


def environment(device: torch.device) -> dict:
    """What the figures were measured on, and which LM-head loss the flexsp contenders ran."""
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    probe_h = torch.zeros(2, 8, device=device, requires_grad=True)
    refusal = library_refusal(probe_h, torch.zeros(4, 8, device=device), None, torch.bfloat16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"device": f"{device.type.upper()} {name}", "torch": torch.__version__,
            "transformers": version("transformers"), "liger_kernel": version("liger-kernel"),
            "lm_head_loss": "liger-kernel" if refusal is None else f"flexsp's own ({refusal})",
            "cpus": os.cpu_count()}


def report(groups: dict, env: dict, spec: ModelSpec, gpu: bool) -> tuple[str, bool]:
    lines = [f"# GPU step benchmark ({'measured on ' + env['device'] if gpu else 'CPU run: measured nothing about GPUs'})",
             "",
             f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, liger-kernel "
             f"{env['liger_kernel']}; LM-head loss: {env['lm_head_loss']}. Shape {spec.name}: {spec.layers} layers, "
             f"hidden {spec.hidden}, {spec.heads} q / {spec.kv_heads} kv heads, ffn {spec.ffn}, vocab {spec.vocab}. "
             "Median wall ms of interleaved rounds; peak = allocator (CUDA) or resident-set (CPU) growth over a step.",
             "", "| group | contender | ms / step | TFLOP/s | MFU | peak MiB | rounds | first loss | attention ran |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines.insert(3, f"Tiny group size: {groups.get('size', 'as named')}.")
    lines.insert(4, "")
    for key, g in groups.items():
        if key == "size":
            continue
        kernels = g.get("kernels") or {}
        key = f"{key} ({describe(g['lengths'])})"
        if "error" in g:
            lines.append(f"| {key} | (group failed: {g['error']}) | | | | | | | |")
            continue
        for name, s in g["summary"].items():
            if s["failed"] and not s.get("ms"):
                lines.append(f"| {key} | {name} | {s['failed']} | | | | | | |")
                continue
            ran_text = ran.describe(kernels[name]) if "forward" in kernels.get(name, {}) else "?"
            lines.append(f"| {key} | {name} | {s['ms']:.1f} | {s['tflops']:.1f} | {100 * s['mfu']:.1f}% | "
                         f"{s['peak_mib']:.0f} | {s['rounds']} | {s['first_loss']:.6f} | {ran_text} |"
                         + (f" failed later: {s['failed']}" if s["failed"] else ""))
    lines += ["", "Targets (issue 36)" + ("" if gpu else " - a CPU run says nothing about them:")]
    ok = True
    for what, value, op, target, met in verdicts(groups):
        ok &= met
        lines.append(f"- {what}: {value:.3f} (target {op} {target}) {'met' if met else 'MISSED'}")
    return "\n".join(lines) + "\n", ok


def write(path: Path, groups: dict, env: dict, spec: ModelSpec, args, gpu: bool) -> None:
    """The results so far as JSON (written after every group: a run cut short keeps what it measured)."""
    data = {"source": "experiments/gpu_step_benchmark.py", "measured_on_gpu": gpu, **env,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "spec": spec.name, "dtype": args.dtype,
            "backend": args.backend, "loss_kernel": args.loss_kernel, "targets": TARGETS,
            "size": groups.get("size"),
            "groups": {k: {"lengths": g.get("lengths"), "flops": g.get("flops"), "error": g.get("error"),
                           "first_losses": g.get("first_losses"), "contenders": g.get("summary"),
                           "kernels": g.get("kernels")}
                       for k, g in groups.items() if k != "size"},
            "verdicts": [{"what": w, "value": v, "target": f"{op} {t}", "met": m} for w, v, op, t, m in verdicts(groups)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI on CPU: a tiny shape, fp32, one round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per group (at most)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall seconds for all groups; no new round starts in a group past its share")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 (fp32 with --quick)")
    parser.add_argument("--backend", default="auto", help="attention backend of the flexsp contenders")
    parser.add_argument("--loss-kernel", choices=KERNELS, default=None,
                        help="the flexsp contenders' LM-head loss (default: auto, the library where it serves)")
    parser.add_argument("--groups", default="tiny,hf,short,long", help="which groups to run, in order")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"results JSON (default: {RESULTS.relative_to(RESULTS.parents[2])} on a GPU, a temporary "
                             "folder otherwise)")
    args = parser.parse_args()
    start = time.monotonic()
    if not args.quick and not torch.cuda.is_available():
        parser.exit(2, "No CUDA device: the full Llama-3-8B-layer shape needs a GPU; --quick checks the machinery on "
                       "CPU. Nothing was measured or written.\n")
    gpu = not args.quick
    device = torch.device("cuda" if gpu else "cpu")
    args.dtype = args.dtype or ("fp32" if args.quick or not gpu else "bf16")
    if args.quick:
        args.rounds = min(args.rounds, 1)
    spec = SPEC if not args.quick else QUICK_SPEC
    scale = 1 if not args.quick else 128
    mixed = tuple(max(2, n // scale) for n in MIXED)
    memory = torch.cuda.get_device_properties(0).total_memory if gpu else None
    tiny_mixed, size = fit_tiny(spec, mixed, memory)
    print(f"tiny group: {size}", flush=True)
    short = tuple(max(2, n // scale) for n in SHORT[:16 if args.quick else None])
    long = tuple(max(2, n // scale) for n in LONG)
    output = args.output or (RESULTS if gpu else Path(tempfile.mkdtemp(prefix="gpu_step_")) / "gpu_step.json")
    meter = CudaMeter() if gpu else HostMeter()
    if not gpu:
        torch.set_num_threads(1)
        print("No GPU in this run: it checks the benchmark's machinery and measured nothing about GPUs.", flush=True)
    # shard_model wants a process group; a world of one runs no collective, so gloo serves on either device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}; LM-head loss: {env['lm_head_loss']}", flush=True)
    wanted = [g.strip() for g in args.groups.split(",") if g.strip()]
    plan = {"tiny": ("tiny mixed", tiny_mixed), "hf": ("hf mixed", mixed), "short": ("hf short", short),
            "long": ("hf long", long)}
    groups: dict = {"size": size}
    native = None
    try:
        for i, key in enumerate(wanted):
            name, lengths = plan[key]
            left = max(1.0, args.budget_s - (time.monotonic() - start))
            deadline = time.monotonic() + left / (len(wanted) - i)
            batch = batch_of(lengths, spec.vocab, device)
            group: dict = {"lengths": list(lengths), "flops": spec.training_flops(lengths)}
            try:
                if key == "tiny":
                    group.update(tiny_group(spec, batch, args, deadline, meter))
                else:
                    if native is None:
                        torch.manual_seed(0)
                        with device:
                            native = hf_model(spec).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
                    group.update(hf_group(native, batch, args, deadline, meter))
                group["summary"] = {n: summary(c, group["flops"]) for n, c in group["contenders"].items()}
                group["kernels"] = kernels_of(group["contenders"])
            except (RuntimeError, ValueError, ImportError) as exc:   # one group's failure (an unsupported model...)
                group["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            group.pop("contenders", None)   # free this group's models and optimizer states before the next
            groups[name] = group
            write(output, groups, env, spec, args, gpu)
            print(f"{name}: done ({time.monotonic() - start:.0f} s)", flush=True)
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    text, ok = report(groups, env, spec, gpu)
    print(text)
    print(f"results: {output}")
    if not ok:
        print("MISSED: at least one target (see above)" + ("" if gpu else "; a CPU run says nothing about the GPU targets"))


if __name__ == "__main__":
    main()
