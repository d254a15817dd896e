"""Compute profile: time forward + backward of the runtime's model over a sweep of sequence lengths.

The model is ``flexsp.runtime.TinyLM`` built at the real layer shapes (hidden, heads, FFN, vocab), or
the user's own transformers model from its config (``GroupRunner(..., build=hf_builder(config))``),
run through the same adapter training uses.
A big model need not fit: run ``run_layers`` of its ``layers`` blocks and extrapolate,
``T_full(s) = T_0(s) + layers / run_layers * (T_k(s) - T_0(s))``, where ``T_0`` is the same model with
no blocks (embedding, LM head, loss): blocks are identical, so their time is additive.

GPU path (not exercised in CI, which has no GPU; correct by construction): bf16 weights, the
device is synchronised before and after every timed region, so the timer sees finished kernels.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flexsp.plan.specs import ModelSpec, spec_from_hf_config
from flexsp.runtime.models.tiny import TinyLM
from flexsp.runtime.shard import pack
from flexsp.runtime.sp.context import IGNORE_INDEX, AttentionContext, Shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# wall: what training sees (GPU: after a device sync). cpu: this process's CPU seconds, which leave out
# the time other processes took the cores - on a shared CPU box with --threads 1 it is what a dedicated
# core would take; meaningless for GPUs (kernels run off the CPU) and for several threads (it sums them).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class DeviceSetup:
    """Where and how the model runs: device, parameter dtype, attention backend."""

    device: torch.device
    dtype: torch.dtype
    backend: str = "auto"

    @classmethod
    def resolve(cls, device: str = "auto", dtype: str = "auto", backend: str = "auto") -> "DeviceSetup":
        """``auto``: the local CUDA device in bf16 when there is one, else the CPU in fp32 (bf16 matmuls
        on CPU are slow and unrepresentative)."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dtype == "auto":
            dtype = "bf16" if dev.type == "cuda" else "fp32"
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or auto")
        if backend == "auto" and dev.type == "cpu":
            backend = "sdpa_each"   # per-sequence work (sum of s^2) as a GPU varlen kernel does, not T^2
        return cls(dev, DTYPES[dtype], backend)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        import platform
        return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def make_shard(lengths: Sequence[int], degree: int, local_rank: int, vocab: int, device: torch.device,
               group: dist.ProcessGroup | None, backend: str, seed: int = 0) -> tuple[Shard, AttentionContext]:
    """Random token ids for ``lengths`` packed for a group of ``degree``; this rank's shard and context."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (int(n),), generator=gen) for n in lengths]
    packed = pack(seqs, degree)
    shard = packed.shard(local_rank).to(device)
    # the runtime's own context: cu_seqlens on the device and as host ints (the per-sequence kernels and the
    # linear-attention path read the host bounds; a tuple alone broke Gated DeltaNet layers)
    return shard, packed.context(device, group=group, backend=backend)


def forward_backward(model: nn.Module, shard: Shard, ctx: AttentionContext) -> None:
    """One training micro-step on a shard, as ``StepExecutor`` runs it (no optimizer step): the
    model's own ``shard_loss`` when it has one (the HF adapter's chunked loss), else logits + CE."""
    model.zero_grad(set_to_none=True)
    if hasattr(model, "shard_loss"):
        loss = model.shard_loss(shard.input_ids, shard.position_ids, shard.labels, ctx)
    else:
        logits = model(shard.input_ids, shard.position_ids, ctx)
        loss = F.cross_entropy(logits.float(), shard.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()


def hf_builder(config: Any, *, max_seqlen: int | None = None,
               attn_implementation: str = "sdpa") -> tuple[ModelSpec, Callable[[int], nn.Module]]:
    """The shape of a transformers config (a directory with config.json, a config, or a built-in tiny
    arch name) and a function building that model with ``layers`` decoder layers behind FlexSP's adapter."""
    from flexsp.hf.prepare import from_config, load_config, with_layers
    cfg = load_config(config)
    spec = spec_from_hf_config(cfg)

    def build(layers: int) -> nn.Module:
        return from_config(with_layers(cfg, layers), attn_implementation=attn_implementation, max_seqlen=max_seqlen)

    return spec, build


class GroupRunner:
    """Times one SP group's forward + backward of the full model (extrapolated from ``run_layers``)."""

    def __init__(self, spec: ModelSpec, setup: DeviceSetup, run_layers: int | None = None, seed: int = 0,
                 clock: str = "wall", build: Callable[[int], nn.Module] | None = None) -> None:
        """``build(layers)`` makes the model to time (default: ``TinyLM`` at ``spec``'s shapes)."""
        if clock not in CLOCKS:
            raise ValueError(f"unknown clock {clock!r}; choose one of {sorted(CLOCKS)}")
        if clock == "cpu" and setup.device.type != "cpu":
            raise ValueError(f"clock 'cpu' only measures CPU runs; the model runs on {setup.device}")
        self.clock = CLOCKS[clock]
        run_layers = spec.layers if run_layers is None else int(run_layers)
        if not 1 <= run_layers:
            raise ValueError(f"run_layers must be >= 1, got {run_layers}")
        self.spec, self.setup = spec, setup
        self.run_layers = min(run_layers, spec.layers)
        build = build or (lambda layers: TinyLM(spec.with_layers(layers)))
        torch.manual_seed(seed)
        self.model = build(self.run_layers).to(setup.device, setup.dtype)
        # Blocks are identical, so the rest of the model is measured once without any.
        self.base = None if self.run_layers == spec.layers else build(0).to(setup.device, setup.dtype)

    @property
    def scale(self) -> float:
        return self.spec.layers / self.run_layers

    def models(self) -> list[tuple[nn.Module, float]]:
        """(model, weight) pairs whose weighted sum of measurements is the full model's:
        full = k-block model * scale + base * (1 - scale)."""
        if self.base is None:
            return [(self.model, 1.0)]
        return [(self.model, self.scale), (self.base, 1.0 - self.scale)]

    def _time_once(self, model: nn.Module, shard: Shard, ctx: AttentionContext) -> float:
        if ctx.group is not None:
            dist.barrier(group=ctx.group)   # start together: the group's time is its slowest rank's
        # Waiting on peers inside an all-to-all costs no CPU time but is real time: wall clock for groups.
        clock = self.clock if ctx.group is None else time.perf_counter
        self.setup.sync()
        start = clock()
        forward_backward(model, shard, ctx)
        self.setup.sync()
        return clock() - start

    def time_group(self, lengths: Sequence[int], *, group: dist.ProcessGroup | None = None, local_rank: int = 0,
                   repeats: int = 3, warmup: int = 1, seed: int = 0) -> list[float]:
        """Seconds of each of ``repeats`` runs of the group (slowest member), after ``warmup`` runs."""
        degree = 1 if group is None else dist.get_world_size(group)
        shard, ctx = make_shard(lengths, degree, local_rank, self.spec.vocab, self.setup.device, group,
                                self.setup.backend, seed)
        parts = self.models()
        for _ in range(warmup):
            for model, _w in parts:
                forward_backward(model, shard, ctx)
        times = []
        for _ in range(repeats):
            total = sum(w * self._time_once(m, shard, ctx) for m, w in parts)
            if group is not None:
                slowest = torch.tensor([total], dtype=torch.float64, device=self.setup.device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                total = float(slowest.item())
            times.append(total)
        return times


def matmul_rate(setup: DeviceSetup, size: int | None = None) -> float:
    """FLOP/s of one square matmul in the setup's dtype on its device (after one warm-up): the
    device's best case, for a sweep estimate before any model run (a model reaches a fraction of it)."""
    size = size or (4096 if setup.device.type == "cuda" else 512)
    a = torch.randn(size, size, device=setup.device, dtype=setup.dtype)
    clock = CLOCKS["wall"]
    a @ a
    setup.sync()
    start = clock()
    a @ a
    setup.sync()
    return 2.0 * size ** 3 / max(clock() - start, 1e-9)


@dataclass(frozen=True)
class ComputeSweep:
    lengths: tuple[int, ...]    # one entry per timed run (lengths repeat)
    seconds: tuple[float, ...]


def compute_sweep(runner: GroupRunner, lengths: Sequence[int], *, repeats: int = 3, warmup: int = 1,
                  progress=None, first: Callable[[int, float], None] | None = None) -> ComputeSweep:
    """Time one sequence of every length at SP degree 1, ``repeats`` times each.

    ``first(length, seconds)`` is called after one timed run of the first length, before the rest (the
    caller's estimate of the whole sweep); that run stands in for one of the first length's warm-ups."""
    xs, ts = [], []
    spent = 0
    if first is not None and lengths:
        first(int(lengths[0]), runner.time_group([int(lengths[0])], repeats=1, warmup=0, seed=0)[0])
        spent = 1
    for i, n in enumerate(lengths):
        times = runner.time_group([int(n)], repeats=repeats, warmup=max(0, warmup - spent) if i == 0 else warmup,
                                  seed=i)
        xs.extend([int(n)] * len(times))
        ts.extend(times)
        if progress is not None:
            ordered = sorted(times)
            progress(f"compute: {int(n):>7} tokens  min {ordered[0] * 1e3:9.2f} ms  median "
                     f"{ordered[len(ordered) // 2] * 1e3:9.2f} ms")
    return ComputeSweep(tuple(xs), tuple(ts))
