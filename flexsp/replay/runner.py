"""Run one rank of one SP group on this device, as the training runtime would, and time it.

The model is called through the same entry points the executor uses: ``shard_loss(input_ids,
position_ids, labels, ctx)`` when the model implements the ``SPModel`` protocol, otherwise
``model(input_ids, position_ids, ctx)`` followed by the summed next-token cross-entropy. Its attention
goes through ``flexsp.runtime.sp.ulysses.ulysses_attention``, which uses the context's ``exchange``: here
``LocalExchange``, so no process group is needed.

A big model need not fit: ``ReplayModel.from_spec(..., run_layers=k)`` runs ``k`` of its blocks and
scales, ``T = T_0 + layers / k * (T_k - T_0)`` with ``T_0`` the model without blocks (embedding, head,
loss); blocks are identical, so their time adds up (the same rule as ``flexsp profile``).

GPU path (no GPU in CI): bf16 weights, the device is synchronised before and after every timed run,
warm-up runs are untimed, and the peak memory of each group is recorded.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flexsp.errors import FlexSPError
from flexsp.plan.specs import ModelSpec
from flexsp.profile.compute import CLOCKS, DeviceSetup
from flexsp.replay.exchange import LocalExchange
from flexsp.runtime.models.tiny import TinyLM
from flexsp.runtime.shard import pack
from flexsp.runtime.sp.context import IGNORE_INDEX, AttentionContext


class ReplayError(FlexSPError):
    """A plan, model or setting that a replay cannot run."""


@dataclass(frozen=True)
class ReplayModel:
    """What runs: ``parts`` are (model, weight) pairs whose weighted sum of timings is the full model's."""

    parts: tuple[tuple[nn.Module, float], ...]
    heads: int
    kv_heads: int
    vocab: int
    shape: ModelSpec | None = None     # for the check against the cost model's recorded shape
    run_layers: int | None = None

    @classmethod
    def from_spec(cls, spec: ModelSpec, setup: DeviceSetup, run_layers: int | None = None,
                  seed: int = 0) -> "ReplayModel":
        """The runtime's ``TinyLM`` at ``spec``'s shapes, ``run_layers`` blocks of ``spec.layers`` (all by default)."""
        k = spec.layers if run_layers is None else int(run_layers)
        if k < 1:
            raise ReplayError(f"run_layers must be >= 1, got {k}")
        k = min(k, spec.layers)
        torch.manual_seed(seed)
        model = TinyLM(spec.with_layers(k)).to(setup.device, setup.dtype)
        if k == spec.layers:
            parts = ((model, 1.0),)
        else:
            base = TinyLM(spec.with_layers(0)).to(setup.device, setup.dtype)
            parts = ((model, spec.layers / k), (base, 1.0 - spec.layers / k))
        return cls(parts, spec.heads, spec.kv_heads, spec.vocab, spec, k)


def shard_work(cu_seqlens: Sequence[int], degree: int) -> list[tuple[int, int]]:
    """(real tokens, labelled tokens) of every local rank's shard, as ``pack`` cuts the stream."""
    real = cu_seqlens[-1]
    n = -(-real // degree)
    ends = np.asarray(cu_seqlens[1:]) - 1          # a sequence's last token has no label
    out = []
    for r in range(degree):
        lo, hi = r * n, min((r + 1) * n, real)
        tokens = max(0, hi - lo)
        out.append((tokens, tokens - int(np.count_nonzero((ends >= lo) & (ends < hi)))))
    return out


def representative_ranks(lengths: Sequence[int], degree: int, tolerance: float = 0.05) -> tuple[int, ...]:
    """Local ranks to replay: the one with the most work first, then one of each other kind of shard
    whose real or labelled tokens differ from every chosen one by more than ``tolerance`` of a shard.

    Every rank of a Ulysses group runs the same token count (padding included) and the same attention
    (all tokens, heads/d heads); shards differ only in how much of them is padding and labelled, at
    most ``degree - 1`` tokens, so usually one rank suffices."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    work = shard_work(cu, degree)
    shard = max(1, -(-cu[-1] // degree))
    order = sorted(range(degree), key=lambda r: (-work[r][1], -work[r][0], r))
    chosen: list[int] = []
    for r in order:
        if all(max(abs(work[r][0] - work[c][0]), abs(work[r][1] - work[c][1])) > tolerance * shard for c in chosen):
            chosen.append(r)
    return tuple(chosen)


def replay_context(cu_seqlens: Sequence[int], max_seqlen: int, exchange: LocalExchange, backend: str,
                   device: torch.device) -> AttentionContext:
    """An ``AttentionContext`` without a process group, whichever form its ``cu_seqlens`` takes
    (a host tuple, or an int32 device tensor built once per micro-batch)."""
    field = {f.name: f for f in dataclasses.fields(AttentionContext)}["cu_seqlens"]
    cu: Any = tuple(int(c) for c in cu_seqlens)
    if "Tensor" in str(field.type):
        cu = torch.tensor(cu, dtype=torch.int32, device=device)
    return AttentionContext(cu_seqlens=cu, max_seqlen=int(max_seqlen), group=None, backend=backend, exchange=exchange)


def shard_loss(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
               ctx: AttentionContext) -> torch.Tensor:
    """The executor's loss on one shard: the model's own ``shard_loss`` when it has one."""
    if hasattr(model, "shard_loss"):
        return model.shard_loss(input_ids, position_ids, labels, ctx)
    logits = model(input_ids, position_ids, ctx)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


@dataclass(frozen=True)
class RankTiming:
    samples: tuple[float, ...]
    peak_memory_bytes: int | None


class RankRunner:
    """Times forward + backward of one local rank of a group on ``setup``'s device."""

    def __init__(self, model: ReplayModel, setup: DeviceSetup, *, repeats: int = 3, warmup: int = 1,
                 clock: str = "wall", seed: int = 0) -> None:
        if clock not in CLOCKS:
            raise ReplayError(f"unknown clock {clock!r}; choose one of {sorted(CLOCKS)}")
        if clock == "cpu" and setup.device.type != "cpu":
            raise ReplayError(f"clock 'cpu' only measures CPU runs; the model runs on {setup.device}")
        if repeats < 1 or warmup < 0:
            raise ReplayError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
        self.model, self.setup, self.repeats, self.warmup, self.seed = model, setup, repeats, warmup, seed
        self.clock: Callable[[], float] = CLOCKS[clock]

    def inputs(self, lengths: Sequence[int], degree: int, rank: int, seed: int):
        """Random tokens for ``lengths`` packed for ``degree`` ranks: ``rank``'s shard and its context."""
        gen = torch.Generator().manual_seed(seed)
        packed = pack([torch.randint(1, self.model.vocab, (int(n),), generator=gen) for n in lengths], degree)
        shard = packed.shard(rank)
        dev = self.setup.device
        tensors = (shard.input_ids.to(dev), shard.position_ids.to(dev), shard.labels.to(dev))
        ctx = replay_context(packed.cu_seqlens, packed.max_seqlen, LocalExchange(degree, rank), self.setup.backend, dev)
        return tensors, ctx

    def _run(self, module: nn.Module, tensors, ctx) -> None:
        module.zero_grad(set_to_none=True)
        shard_loss(module, *tensors, ctx).backward()

    def time_rank(self, lengths: Sequence[int], degree: int, rank: int, seed: int = 0) -> RankTiming:
        tensors, ctx = self.inputs(lengths, degree, rank, self.seed + seed)
        cuda = self.setup.device.type == "cuda"
        if cuda:
            self.setup.sync()
            torch.cuda.reset_peak_memory_stats(self.setup.device)
        for _ in range(self.warmup):
            for module, _w in self.model.parts:
                self._run(module, tensors, ctx)
        samples = []
        for _ in range(self.repeats):
            total = 0.0
            for module, weight in self.model.parts:
                self.setup.sync()
                start = self.clock()
                self._run(module, tensors, ctx)
                self.setup.sync()
                total += weight * (self.clock() - start)
            samples.append(total)
        peak = int(torch.cuda.max_memory_allocated(self.setup.device)) if cuda else None
        return RankTiming(tuple(samples), peak)
