"""Degree-1 step benchmark (issue 30): FlexSP's executed step against the loops it replaces, one process.

Same weights, same batch, one training step each (forward + backward + AdamW), TinyLM 3 layers /
hidden 256 / 4 q and 2 kv heads / vocab 8192, fp32, at about 1K, 4K and 16K tokens of a long-tailed
length mix (the issue's [2048, 1024, 512, 256, 256] scaled to the total):

* ``flexsp``: ``StepExecutor.run_plan`` on a one-group degree-1 plan, ``backend="auto"`` (packing included);
* ``plain loop``: one forward per sequence, ``F.scaled_dot_product_attention(is_causal=True)`` on 4-D
  tensors (``flexsp.runtime.models.plain``);
* ``4-D mask``: the whole pack in one forward, one SDPA call per layer under a ``[1, 1, T, T]``
  block-causal mask.

And the same for a Hugging Face model (a transformers Llama of the same shape, ``attn_implementation="sdpa"``):

* ``flexsp hf``: ``flexsp.hf.prepare_model(model).shard_loss`` on the packed batch with an
  ``AttentionContext.packed`` of its bounds (degree 1, no process group);
* ``hf packed``: the model called natively on the pack with per-sequence ``position_ids`` (transformers
  detects the packing and builds its block-causal mask);
* ``hf each``: the model called natively once per sequence (no mask: SDPA's ``is_causal``).

Contenders run interleaved (rotating order) for ``repeats`` rounds after a warm-up; the figure is
the median step time. Peak memory: growth of the resident set's high-water mark (``VmHWM``, reset
before each measured step) above the resident set at the step's start (Linux; CPU only). Targets:
flexsp >= 0.95x the best plain loop's speed (ratio = other's time / flexsp's time), peak memory
within 1.2x of the plain loop's; ``flexsp hf`` >= 0.95x the faster native HF path; a miss prints
MISSED. The losses of all contenders must agree (asserted for the HF rows: fp32 tolerance).

    python experiments/step_benchmark.py            # 1K, 4K, 16K tokens; writes experiments/results/step_benchmark.md
    python experiments/step_benchmark.py --quick --out /tmp/step.md   # CI: 256 tokens, 2 rounds
"""
from __future__ import annotations

import argparse
import copy
import math
import ctypes
import gc
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.plain import masked_loss, plain_loss  # noqa: E402
from flexsp.runtime.models.protocol import loss_dtype  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.sp.context import IGNORE_INDEX, AttentionContext  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIX = (2048, 1024, 512, 256, 256)
SPEC = ModelSpec(vocab=8192, hidden=256, layers=3, heads=4, kv_heads=2, ffn=688, name="bench-256")
SPEED_TARGET, MEMORY_TARGET = 0.95, 1.2


def lengths_for(total: int) -> list[int]:
    """The issue's length mix scaled to ``total`` tokens (each at least 2)."""
    scale = total / sum(MIX)
    return [max(2, round(n * scale)) for n in MIX]


class HostMeter:
    """How a step is timed and its memory measured on the host: wall and this process's CPU time; peak =
    growth of the resident high-water mark over one step (Linux). ``experiments/gpu_step_benchmark.py``
    swaps in a CUDA meter (synchronised wall time, the allocator's peak)."""

    recoverable: tuple[type[BaseException], ...] = ()    # errors that fail one contender, not the run

    def time(self, run: Callable[[], float]) -> tuple[float, float, float]:
        """``(loss, wall seconds, CPU seconds)`` of ``run()``."""
        start, cpu = time.perf_counter(), time.process_time()
        loss = run()
        return loss, time.perf_counter() - start, time.process_time() - cpu

    def peak_mib(self, run: Callable[[], float]) -> float:
        """Resident high-water mark growth over ``run()`` (Linux), MiB; NaN where /proc cannot be reset."""
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return float("nan")
        before = _status_kib("VmRSS")
        run()
        return (_status_kib("VmHWM") - before) / 1024


HOST = HostMeter()


class Contender:
    """One way to run the step, with its own copy of the weights and its own AdamW."""

    def __init__(self, name: str, model: TinyLM, batch: list[torch.Tensor]) -> None:
        self.name, self.model, self.batch = name, model, batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "flexsp":
            self.executor = StepExecutor(model, self.optimizer, GroupPool())
            self.plan = Plan(num_gpus=1, predicted_time=0.0,
                             micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=tuple(range(len(batch)))),)),))
        self.seconds: list[float] = []             # wall clock
        self.cpu: list[float] = []                 # this process's CPU time: what a loaded machine blurs least
        self.losses: list[float] = []
        self.peak_mib = float("nan")
        self.failed: str | None = None             # why it stopped (a meter's recoverable error), None: it ran

    def step(self, meter: HostMeter = HOST) -> float:
        """One timed step (wall and CPU seconds recorded); returns its loss (NaN once it has failed)."""
        if self.failed:
            return float("nan")
        try:
            loss, wall, cpu = meter.time(self.run)
        except meter.recoverable as exc:
            self.fail(exc)
            return float("nan")
        self.seconds.append(wall)
        self.cpu.append(cpu)
        self.losses.append(loss)
        return loss

    def fail(self, exc: BaseException) -> None:
        """Record why this contender stopped and drop what its step held (its gradients)."""
        self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()

    def run(self) -> float:
        """Forward, backward and optimizer step, untimed."""
        if self.name == "flexsp":
            return self.executor.run_plan(self.plan, self.batch).loss
        self.optimizer.zero_grad(set_to_none=True)
        value = (plain_loss if self.name == "plain loop" else masked_loss)(self.model, self.batch)
        value.backward()
        self.optimizer.step()
        return float(value.detach())


HF_NAMES = ("flexsp hf", "hf packed", "hf each")


class HFContender(Contender):
    """One way to run a transformers causal LM's step: the FlexSP adapter, or the model called natively."""

    def __init__(self, name: str, model: torch.nn.Module, batch: list[torch.Tensor], backend: str = "auto") -> None:
        self.name, self.model, self.batch = name, model, batch
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        lengths, device = [s.numel() for s in batch], batch[0].device
        self.ids = torch.cat(batch)
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        self.labels = torch.cat([torch.cat([s[1:], torch.tensor([IGNORE_INDEX], device=device)]) for s in batch])
        self.ctx = AttentionContext.packed([0, *torch.tensor(lengths).cumsum(0).tolist()], device, backend=backend)
        self.count = sum(n - 1 for n in lengths)
        self.seconds, self.cpu, self.losses, self.peak_mib, self.failed = [], [], [], float("nan"), None

    def loss(self) -> torch.Tensor:
        """Mean next-token loss over the batch (a sum over tokens / their count, whatever the path)."""
        if self.name == "flexsp hf":
            return self.model.shard_loss(self.ids, self.positions, self.labels, self.ctx) / self.count
        if self.name == "hf packed":
            logits = self.model(input_ids=self.ids[None], position_ids=self.positions[None], use_cache=False).logits[0]
            return F.cross_entropy(logits.to(loss_dtype(logits.dtype)), self.labels, reduction="sum") / self.count
        total = 0.0
        for s in self.batch:
            logits = self.model(input_ids=s[None], use_cache=False).logits[0, :-1]
            total = total + F.cross_entropy(logits.to(loss_dtype(logits.dtype)), s[1:], reduction="sum")
        return total / self.count

    def run(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        value = self.loss()
        value.backward()
        self.optimizer.step()
        return float(value.detach())


def hf_model(spec: ModelSpec) -> torch.nn.Module:
    """A random-init transformers Llama of ``spec``'s shape, fp32, SDPA attention."""
    from transformers import AutoModelForCausalLM

    from flexsp.hf import tiny_config
    cfg = tiny_config("llama", vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                      max_position_embeddings=max(4096, 2 * MIX[0] * 8))
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure(contenders: list[Contender], repeats: int, meter: HostMeter = HOST,
            deadline: float | None = None) -> list[float]:
    """Warm-up (the first losses: same weights, same batch), interleaved rounds in rotating order (at most
    ``repeats``; past ``deadline``, a ``time.monotonic()``, no new round starts once one has run), then one
    step each for peak memory. A contender that fails (``meter.recoverable``) is skipped from then on."""
    first = [c.step(meter) for c in contenders]
    for c in contenders:
        c.seconds.clear()
        c.cpu.clear()
    n = len(contenders)
    for r in range(repeats):
        if r and deadline is not None and time.monotonic() > deadline:
            break
        for c in contenders[r % n:] + contenders[:r % n]:
            c.step(meter)
    for c in contenders:
        if not c.failed:
            try:
                c.peak_mib = meter.peak_mib(c.run)
            except meter.recoverable as exc:
                c.fail(exc)
    return first


def run_size(total: int, repeats: int, spec: ModelSpec, hf: bool = True) -> dict:
    lengths = lengths_for(total)
    g = torch.Generator().manual_seed(total)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g) for n in lengths]
    torch.manual_seed(0)
    base = TinyLM(spec)
    contenders = [Contender(name, copy.deepcopy(base), batch) for name in ("flexsp", "plain loop", "4-D mask")]
    out = {"total": sum(lengths), "lengths": lengths, "first_losses": measure(contenders, repeats),
           "contenders": {c.name: c for c in contenders}}
    if hf:
        from flexsp.hf import prepare_model
        torch.manual_seed(0)
        native = hf_model(spec)
        models = {"flexsp hf": prepare_model(copy.deepcopy(native)), "hf packed": copy.deepcopy(native), "hf each": native}
        hf_contenders = [HFContender(name, models[name], batch) for name in HF_NAMES]
        first = measure(hf_contenders, repeats)
        if not all(math.isclose(x, first[0], rel_tol=1e-5) for x in first):   # fp32: the same step, other kernels
            raise AssertionError(f"HF contenders' losses differ: {dict(zip(HF_NAMES, first))}")
        out.update(hf_first_losses=first, hf_contenders={c.name: c for c in hf_contenders})
    return out


def report(results: list[dict], device: str, load: tuple[float, ...], threads: int) -> tuple[str, bool]:
    lines = ["# Degree-1 step benchmark\n",
             f"Measured on {device}, {threads} torch threads, load average {load[0]:.1f} / {load[1]:.1f} / "
             f"{load[2]:.1f} at the end (a shared machine: times are noisy; medians of interleaved rounds). "
             f"TinyLM {SPEC.layers} layers / hidden {SPEC.hidden} / {SPEC.heads} q and {SPEC.kv_heads} kv heads / "
             f"vocab {SPEC.vocab}, fp32, forward + backward + AdamW. Produced by `experiments/step_benchmark.py`.\n",
             "Times are CPU seconds of this process per step (one torch thread, so CPU time is the work done and "
             "a busy machine inflates it least), wall seconds in brackets.\n",
             "| tokens (lengths) | flexsp s | plain loop s | 4-D mask s | plain / flexsp | mask / flexsp | "
             "peak MiB flexsp / plain / mask | flexsp / plain memory | loss spread |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    verdicts = []
    for res in results:
        c = res["contenders"]
        ms = {name: median(x.cpu) for name, x in c.items()}
        wall = {name: median(x.seconds) for name, x in c.items()}
        best_plain = min(ms["plain loop"], ms["4-D mask"])
        speed = best_plain / ms["flexsp"]
        memory = c["flexsp"].peak_mib / c["plain loop"].peak_mib if c["plain loop"].peak_mib > 0 else float("nan")
        spread = max(res["first_losses"]) - min(res["first_losses"])
        lines.append(f"| {res['total']} ({', '.join(map(str, res['lengths']))}) | {ms['flexsp']:.2f} ({wall['flexsp']:.1f}) | "
                     f"{ms['plain loop']:.2f} ({wall['plain loop']:.1f}) | {ms['4-D mask']:.2f} ({wall['4-D mask']:.1f}) | "
                     f"{ms['plain loop'] / ms['flexsp']:.2f}x | "
                     f"{ms['4-D mask'] / ms['flexsp']:.2f}x | {c['flexsp'].peak_mib:.0f} / {c['plain loop'].peak_mib:.0f} / "
                     f"{c['4-D mask'].peak_mib:.0f} | {memory:.2f}x | {spread:.1e} |")
        s_ok, m_ok = speed >= SPEED_TARGET, not memory > MEMORY_TARGET
        ok &= s_ok and m_ok and spread < 1e-4
        verdicts.append(f"- {res['total']} tokens: speed vs the best plain loop {speed:.2f}x (target >= "
                        f"{SPEED_TARGET}x) {'met' if s_ok else 'MISSED'}; memory vs the plain loop {memory:.2f}x "
                        f"(target <= {MEMORY_TARGET}x) {'met' if m_ok else 'MISSED'}")
    lines += ["", "Ratios are the other's time over flexsp's (higher is better for flexsp). Targets:", *verdicts]
    hf_results = [res for res in results if "hf_contenders" in res]
    if hf_results:
        hf_lines, hf_ok = hf_report(hf_results)
        lines += hf_lines
        ok &= hf_ok
    return "\n".join(lines) + "\n", ok


def hf_report(results: list[dict]) -> tuple[list[str], bool]:
    """The HF rows: the adapter against the same transformers model run natively (packed / per sequence)."""
    lines = ["", f"**The HF adapter against HF native.** A transformers Llama of the same shape ({SPEC.layers} layers / hidden {SPEC.hidden} / {SPEC.heads} q and "
             f"{SPEC.kv_heads} kv heads / vocab {SPEC.vocab}, fp32, `attn_implementation=\"sdpa\"`), the same batch: "
             "`flexsp hf` is `prepare_model(model).shard_loss` at degree 1 (`AttentionContext.packed`), `hf packed` the "
             "model on the pack with per-sequence `position_ids` (transformers builds its block-causal mask), `hf each` "
             "one native call per sequence. CPU seconds per step, wall seconds in brackets.\n",
             "| tokens | flexsp hf s | hf packed s | hf each s | packed / flexsp hf | each / flexsp hf | "
             "peak MiB flexsp hf / packed / each | loss spread |",
             "|---|---|---|---|---|---|---|---|"]
    ok, verdicts = True, []
    for res in results:
        c = res["hf_contenders"]
        ms = {name: median(x.cpu) for name, x in c.items()}
        wall = {name: median(x.seconds) for name, x in c.items()}
        spread = max(res["hf_first_losses"]) - min(res["hf_first_losses"])
        lines.append(f"| {res['total']} | " + " | ".join(f"{ms[n]:.2f} ({wall[n]:.1f})" for n in HF_NAMES) + " | "
                     f"{ms['hf packed'] / ms['flexsp hf']:.2f}x | {ms['hf each'] / ms['flexsp hf']:.2f}x | "
                     + " / ".join(f"{c[n].peak_mib:.0f}" for n in HF_NAMES) + f" | {spread:.1e} |")
        faster = min(("hf packed", "hf each"), key=ms.get)
        speed = ms[faster] / ms["flexsp hf"]
        met = speed >= SPEED_TARGET
        ok &= met
        verdicts.append(f"- {res['total']} tokens: flexsp hf vs the faster native path ({faster}) {speed:.2f}x "
                        f"(target >= {SPEED_TARGET}x) {'met' if met else 'MISSED'}")
    return lines + ["", "Ratios are native time over the adapter's (higher is better for flexsp). Targets:",
                    *verdicts], ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: 256 tokens, a small model, 2 rounds")
    parser.add_argument("--sizes", default="1024,4096,16384", help="token totals")
    parser.add_argument("--repeats", type=int, default=0, help="rounds per size (default 7, 5, 3 by size)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine more threads only add contention)")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_benchmark.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global SPEC
    sizes = [256] if args.quick else [int(s) for s in args.sizes.split(",")]
    if args.quick:
        SPEC = ModelSpec(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, name="bench-quick")
    results = []
    for total in sizes:
        repeats = args.repeats or (2 if args.quick else 7 if total <= 1024 else 5 if total <= 4096 else 3)
        results.append(run_size(total, repeats, SPEC))
        print(f"{total} tokens done", flush=True)
    device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    text, ok = report(results, device, os.getloadavg(), torch.get_num_threads())
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if not ok:
        print("MISSED: at least one target (see above)")


if __name__ == "__main__":
    main()
