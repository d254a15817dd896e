"""Degree-1 step benchmark (issue 30): FlexSP's executed step against the loops it replaces, one process.

Same weights, same batch, one training step each (forward + backward + AdamW), TinyLM 3 layers /
hidden 256 / 4 q and 2 kv heads / vocab 8192, fp32, at about 1K, 4K and 16K tokens of a long-tailed
length mix (the issue's [2048, 1024, 512, 256, 256] scaled to the total):

* ``flexsp``: ``StepExecutor.run_plan`` on a one-group degree-1 plan, ``backend="auto"`` (packing included);
* ``plain loop``: one forward per sequence, ``F.scaled_dot_product_attention(is_causal=True)`` on 4-D
  tensors (``flexsp.runtime.models.plain``);
* ``4-D mask``: the whole pack in one forward, one SDPA call per layer under a ``[1, 1, T, T]``
  block-causal mask.

Contenders run interleaved (rotating order) for ``repeats`` rounds after a warm-up; the figure is
the median step time. Peak memory: growth of the resident set's high-water mark (``VmHWM``, reset
before each measured step) above the resident set at the step's start (Linux; CPU only). Targets:
flexsp >= 0.95x the best plain loop's speed (ratio = other's time / flexsp's time), peak memory
within 1.2x of the plain loop's; a miss prints MISSED. The losses of all contenders must agree.

    python experiments/step_benchmark.py            # 1K, 4K, 16K tokens; writes experiments/results/step_benchmark.md
    python experiments/step_benchmark.py --quick --out /tmp/step.md   # CI: 256 tokens, 2 rounds
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.plain import plain_loss  # noqa: E402
from flexsp.runtime.models.protocol import loss_dtype  # noqa: E402
from flexsp.runtime.models.tiny import Rotary, TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIX = (2048, 1024, 512, 256, 256)
SPEC = ModelSpec(vocab=8192, hidden=256, layers=3, heads=4, kv_heads=2, ffn=688, name="bench-256")
SPEED_TARGET, MEMORY_TARGET = 0.95, 1.2


def lengths_for(total: int) -> list[int]:
    """The issue's length mix scaled to ``total`` tokens (each at least 2)."""
    scale = total / sum(MIX)
    return [max(2, round(n * scale)) for n in MIX]


def masked_loss(model: TinyLM, sequences: list[torch.Tensor]) -> torch.Tensor:
    """The whole pack in one forward, one SDPA call per layer under a 4-D block-causal mask."""
    cfg = model.cfg
    ids = torch.cat(sequences)
    t = ids.numel()
    seq = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([s.numel() for s in sequences]))
    pos = torch.cat([torch.arange(s.numel()) for s in sequences])
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    x = model.embed(ids)
    rope = Rotary(pos, cfg.head_size, cfg.rope_theta, x.dtype)
    for block in model.blocks:
        attn = block.attn
        h = block.attn_norm(x)
        q = rope.apply(attn.q(h).view(t, cfg.heads, cfg.head_size))
        k, v = attn.kv(h).view(t, 2, cfg.kv_heads, cfg.head_size).unbind(1)
        k = rope.apply(k)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask[None, None], enable_gqa=True)
        x = x + attn.out(out[0].transpose(0, 1).reshape(t, -1))
        x = x + block.mlp(block.mlp_norm(x))
    logits = model._project(model.norm(x))
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in sequences])
    return F.cross_entropy(logits.to(loss_dtype(logits.dtype)), labels, reduction="sum") / sum(s.numel() - 1 for s in sequences)


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

    def step(self) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        if self.name == "flexsp":
            loss = self.executor.run_plan(self.plan, self.batch).loss
        else:
            self.optimizer.zero_grad(set_to_none=True)
            value = (plain_loss if self.name == "plain loop" else masked_loss)(self.model, self.batch)
            value.backward()
            self.optimizer.step()
            loss = float(value.detach())
        self.seconds.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - cpu)
        self.losses.append(loss)
        return loss


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _peak_mib(contender: Contender) -> float:
    """Resident high-water mark growth over one step (Linux), MiB; NaN where /proc cannot be reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = _status_kib("VmRSS")
    contender.step()
    return (_status_kib("VmHWM") - before) / 1024


def run_size(total: int, repeats: int, spec: ModelSpec) -> dict:
    lengths = lengths_for(total)
    g = torch.Generator().manual_seed(total)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g) for n in lengths]
    torch.manual_seed(0)
    base = TinyLM(spec)
    contenders = [Contender(name, copy.deepcopy(base), batch) for name in ("flexsp", "plain loop", "4-D mask")]
    first = [c.step() for c in contenders]                                   # warm-up, same weights: same loss
    for c in contenders:
        c.seconds.clear()
        c.cpu.clear()
    for r in range(repeats):
        for c in contenders[r % 3:] + contenders[:r % 3]:                    # interleaved, rotating order
            c.step()
    for c in contenders:
        c.peak_mib = _peak_mib(c)
    return {"total": sum(lengths), "lengths": lengths, "first_losses": first,
            "contenders": {c.name: c for c in contenders}}


def report(results: list[dict], device: str, load: tuple[float, ...], threads: int) -> tuple[str, bool]:
    lines = [f"# Degree-1 step benchmark\n",
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
    lines += ["", "Ratios are the other's time over flexsp's (higher is better for flexsp). Targets:", *verdicts,
              "", "Not measured here: HF native against the HF adapter (issue 30 point 3)."]
    return "\n".join(lines) + "\n", ok


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
