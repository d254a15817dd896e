"""Per-kind compute profile: a layer of each kind the model has, timed and fitted apart.

A model whose layers differ in their token mixer (``flexsp.plan.layers``: full causal, a window ``w``, chunks
of ``c``, linear attention) costs each kind differently: a full layer's attention grows as ``s^2``, a windowed
one's as ``s w``, a linear one's not at all. So instead of the whole stack, ``kind_sweep`` times, at every
length of the grid, the model with no layers (embedding, LM head, loss) and, for each kind, the model with
``blocks`` layers of that kind only; one layer of a kind is ``(T_kind - T_0) / blocks``
(``fit.layer_seconds``), fitted by ``fit.fit_kind``, and ``fit.combine_kinds`` sums the kinds over the
model's layer counts into ``alpha1`` (full layers), ``window_alpha`` / ``chunk_alpha`` and the linear terms.

The layers run the runtime's own attention (``sp_attention`` with the kind's ``Features``: the window and
chunk masks of ``flexsp.runtime.kernels``, whichever kernel the rule picks on this device). ``TinyLM`` trains
full attention only, so ``KindLM`` is ``TinyLM`` whose attention applies one kind's mask. A transformers model
(``--hf-config``) is built with every layer of one kind (its ``layer_types`` set to that kind), through the
same adapter training uses; that is also how a linear-attention layer (Gated DeltaNet) is timed: ``TinyLM``
has none, and such a kind is reported as not timed (``untimed``), never silently costed as another.
Sinks and MoE FFNs are not built by ``KindLM``: kinds are told apart by their mixer and size.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flexsp.errors import CostModelError
from flexsp.plan.layers import LayerKind, runs
from flexsp.plan.specs import ModelSpec
from flexsp.profile.compute import DeviceSetup, forward_backward, make_shard
from flexsp.runtime.kernels.features import Features
from flexsp.runtime.models.tiny import Attention, Rotary, TinyLM
from flexsp.runtime.sp.attention import sp_attention
from flexsp.runtime.sp.context import AttentionContext

# transformers' layer_types name of each mixer (flexsp.plan.specs reads the same names)
HF_TYPES = {"full": "full_attention", "window": "sliding_attention", "chunk": "chunked_attention",
            "linear": "linear_attention"}


def timed_kinds(spec: ModelSpec) -> list[tuple[LayerKind, int]]:
    """The model's kinds by mixer and size (sinks, MoE and rope set aside) with their layer counts, in order."""
    out: dict[LayerKind, int] = {}
    for kind, count in spec.kind_counts().items():
        bare = LayerKind(kind.mixer, kind.size)
        out[bare] = out.get(bare, 0) + count
    return list(out.items())


def features_of(kind: LayerKind) -> Features:
    return Features(window=kind.size if kind.mixer == "window" else None,
                    chunk=kind.size if kind.mixer == "chunk" else None)


class KindAttention(Attention):
    """``TinyLM``'s attention with one kind's mask, through the runtime's ``sp_attention``."""

    def __init__(self, cfg: ModelSpec, features: Features) -> None:
        super().__init__(cfg)
        self.features = features

    def forward(self, x: torch.Tensor, rope: Rotary, ctx: AttentionContext) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        q = self.q(x).view(tokens, cfg.heads, cfg.head_size)
        k, v = self.kv(x).view(tokens, 2, cfg.kv_heads, cfg.head_size).unbind(1)
        core = sp_attention(rope.apply(q), rope.apply(k), v, ctx, self.features)
        return self.out(core.reshape(tokens, -1))


def tiny_builder(spec: ModelSpec, kind: LayerKind) -> Callable[[int], nn.Module] | None:
    """``build(layers)``: ``TinyLM`` at ``spec``'s shapes with ``layers`` layers of ``kind``; None for a linear
    kind (``TinyLM`` has no linear-attention layer)."""
    if not kind.softmax:
        return None
    return mixed_builder(dataclasses.replace(spec, layers=1, kinds=runs([kind]), experts=0, active_experts=0,
                                             expert_ffn=0, shared_ffn=0))


def mixed_builder(spec: ModelSpec) -> Callable[[int], nn.Module]:
    """``build(layers)``: ``TinyLM`` whose layer ``i`` applies the mask of ``spec.with_layers(layers)``'s kind
    ``i`` (what the check and the memory profile run); a linear-attention layer stays full attention there."""
    plain = dataclasses.replace(spec, kinds=(), experts=0, active_experts=0, expert_ffn=0, shared_ffn=0)

    def build(layers: int) -> nn.Module:
        model = TinyLM(plain.with_layers(layers))
        for block, kind in zip(model.blocks, spec.with_layers(layers).layer_kinds):
            if kind.mixer in ("window", "chunk"):
                old = block.attn
                block.attn = KindAttention(old.cfg, features_of(kind))
                block.attn.load_state_dict(old.state_dict())
        return model

    return build


def kind_lengths(lengths: Sequence[int], spec: ModelSpec) -> tuple[list[int], list[int]]:
    """``(grid, added)``: ``lengths`` with, for each window or chunk that fewer than two of them fall below,
    its half and quarter added: above the window a layer's pairs grow linearly in ``s``, so only shorter
    sequences tell its pair term from its linear term."""
    grid = sorted(set(int(n) for n in lengths))
    added = []
    for kind, _ in timed_kinds(spec):
        if kind.mixer in ("window", "chunk") and sum(n < kind.size for n in grid) < 2:
            for n in (kind.size // 2, kind.size // 4):
                if n >= 8 and n not in grid:
                    added.append(n)
                    grid.append(n)
    return sorted(grid), sorted(added)


def hf_kind_builder(config: Any, spec: ModelSpec, kind: LayerKind, *, max_seqlen: int | None,
                    attn_implementation: str = "sdpa") -> Callable[[int], nn.Module] | str:
    """``build(layers)``: the transformers model of ``config`` with ``layers`` layers, all of ``kind`` (its
    ``layer_types`` set to it); where the config cannot say so (no ``layer_types`` and more than one kind),
    why, as a string."""
    from flexsp.hf.prepare import from_config, load_config, with_layers
    cfg = load_config(config)
    getter = getattr(cfg, "get_text_config", None)
    has_types = getattr(getter() if callable(getter) else cfg, "layer_types", None) is not None
    if not has_types and len(timed_kinds(spec)) > 1:
        return "the model's config has no layer_types, so no model of this kind alone can be built from it"

    def build(layers: int) -> nn.Module:
        one = with_layers(copy.deepcopy(cfg), layers)
        text = one.get_text_config() if callable(getattr(one, "get_text_config", None)) else one
        if has_types:
            text.layer_types = [HF_TYPES[kind.mixer]] * layers
        return from_config(one, attn_implementation=attn_implementation, max_seqlen=max_seqlen)

    return build


@dataclass(frozen=True)
class KindSweep:
    """Seconds of every timed run: ``base`` the model without layers, ``kinds[i]`` with ``blocks`` layers of
    ``timed[i]``; ``lengths`` one entry per run (lengths repeat), the same for all."""

    lengths: tuple[int, ...]
    base: tuple[float, ...]
    timed: tuple[tuple[LayerKind, int], ...]     # (kind, layers of it in the model)
    kinds: tuple[tuple[float, ...], ...]
    untimed: tuple[tuple[LayerKind, int, str], ...]   # (kind, layers, why it was not timed)
    blocks: int


def kind_sweep(spec: ModelSpec, setup: DeviceSetup, lengths: Sequence[int], *, blocks: int = 2, repeats: int = 3,
               warmup: int = 1, clock: Callable[[], float], seed: int = 0,
               builders: dict[LayerKind, Callable[[int], nn.Module] | str | None] | None = None,
               base_build: Callable[[int], nn.Module] | None = None, progress=None) -> KindSweep:
    """Time the model without layers and with ``blocks`` layers of each kind, ``repeats`` times at every length
    (the models run in turn at each length, so drift on a shared machine falls on all alike). ``builders`` maps
    each kind to its ``build(layers)``, or to why it cannot be built here (a string; None: the reason TinyLM has)."""
    kinds = timed_kinds(spec)
    builders = builders if builders is not None else {k: tiny_builder(spec, k) for k, _ in kinds}
    timed, untimed = [], []
    for kind, count in kinds:
        build = builders.get(kind)
        if build is None or isinstance(build, str):
            why = build or ("the runtime's TinyLM has no linear-attention layer (profile a transformers model with "
                            "--hf-config to time one)")
            untimed.append((kind, count, why))
        else:
            timed.append((kind, count))
    if not timed:
        raise CostModelError("no layer kind of this model can be timed here: "
                             + "; ".join(f"{k.describe()}: {why}" for k, _, why in untimed))
    torch.manual_seed(seed)
    base = (base_build or builders[timed[0][0]])(0).to(setup.device, setup.dtype)
    models = [builders[k](blocks).to(setup.device, setup.dtype) for k, _ in timed]
    if isinstance(base, TinyLM):        # one embedding and LM head for all (a big vocabulary's are most of the bytes)
        for model in models:
            if isinstance(model, TinyLM):
                model.embed, model.lm_head, model.norm = base.embed, base.lm_head, base.norm
    xs, base_t, kind_t = [], [], [[] for _ in timed]
    for i, n in enumerate(lengths):
        shard, ctx = make_shard([int(n)], 1, 0, spec.vocab, setup.device, None, setup.backend, seed + i)
        for model in (base, *models):
            for _ in range(warmup):
                forward_backward(model, shard, ctx)
        for _ in range(repeats):
            xs.append(int(n))
            for j, model in enumerate((base, *models)):
                setup.sync()
                start = clock()
                forward_backward(model, shard, ctx)
                setup.sync()
                (base_t if j == 0 else kind_t[j - 1]).append(clock() - start)
        if progress is not None:
            per = "  ".join(f"{k.describe()} {min(t[-repeats:]) * 1e3:8.2f}" for (k, _), t in zip(timed, kind_t))
            progress(f"compute: {int(n):>7} tokens  min ms: no layers {min(base_t[-repeats:]) * 1e3:8.2f}  "
                     f"{blocks} layer(s) of {per}")
    return KindSweep(tuple(xs), tuple(base_t), tuple(timed), tuple(tuple(t) for t in kind_t), tuple(untimed), blocks)


def fit_sweep(sweep: KindSweep, *, statistic: str = "median"):
    """``fit.fit_kinds`` of a ``KindSweep``: the ``fit.KindsModel`` of the model."""
    from flexsp.profile.fit import fit_kinds
    return fit_kinds(sweep.lengths, sweep.base,
                     [(k.mixer, k.size, n, t) for (k, n), t in zip(sweep.timed, sweep.kinds)], sweep.blocks,
                     untimed=[(k.mixer, k.size, n, why) for k, n, why in sweep.untimed], statistic=statistic)
