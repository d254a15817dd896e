"""A small LLaMA-style decoder whose attention is sequence-parallel and everything else token-wise.

RMSNorm, rotary embeddings driven by per-sequence position ids, grouped-query attention, SwiGLU MLP,
tied or untied LM head, built from a ``flexsp.plan.specs.ModelSpec`` (``MODELS["tiny-lm"]`` is the example size). ``forward`` takes one rank's flat token shard; only attention looks past it
(through ``sp_attention``), so the rest runs on the shard as is. It implements ``SPModel``
(``flexsp.runtime.models.protocol``). Precision: whatever the parameter dtype (bf16 under FSDP2 mixed
precision), rotary angles are computed in fp64 once per forward and applied in fp32, norms reduce in fp32, and the
loss is taken on fp32 logits: bf16 angles are off by whole radians past a few thousand positions.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flexsp.errors import CostModelError
from flexsp.plan.memory import check_recompute
from flexsp.plan.specs import ModelSpec
from flexsp.runtime.models.fused_loss import lm_head_loss
from flexsp.runtime.models.protocol import loss_dtype
from flexsp.runtime.sp.attention import sp_attention
from flexsp.runtime.sp.context import AttentionContext


def check_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` if ``TinyLM`` can build it: rotary embeddings need an even head size."""
    if spec.head_size % 2:
        raise CostModelError(f"model {spec.name!r}: head size {spec.head_size} must be even for rotary embeddings")
    return spec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(loss_dtype(x.dtype))   # reduce in fp32 (fp64 stays fp64)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class Rotary:
    """cos/sin of one micro-batch's positions, computed once and shared by every layer (q and k alike).

    Angles in fp64 (a position times a frequency loses whole radians in bf16 and ~1e-2 in fp32 at
    100K positions), cos/sin kept in fp32 (or wider: fp64 models keep fp64); ``apply`` rotates in that
    dtype and returns ``x``'s dtype. ``TinyLM.hidden_states`` builds one per forward, so the cost is one
    ``[tokens, dim/2]`` table per micro-batch, not per layer and per q/k.
    """

    def __init__(self, position_ids: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> None:
        inv_freq = theta ** (-torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float64) / dim)
        angles = position_ids.to(torch.float64).unsqueeze(1) * inv_freq.unsqueeze(0)   # [tokens, dim/2]
        self.dim, self.dtype = dim, loss_dtype(dtype)
        self.cos = angles.cos().to(self.dtype).unsqueeze(1)   # function-form ops throughout: fake CUDA
        self.sin = angles.sin().to(self.dtype).unsqueeze(1)   # tensors (the CI's CUDA check) refuse ``[]``

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [tokens, heads, dim]`` (differentiable in ``x``)."""
        return _Rotate.apply(x, self)

    def turn(self, x: torch.Tensor, sign: float) -> torch.Tensor:
        """``x`` rotated by ``sign`` times the angles, computed in the table's dtype, returned in ``x``'s."""
        half = self.dim // 2
        xw = x.to(self.dtype)
        x1, x2 = xw.narrow(-1, 0, half), xw.narrow(-1, half, half)
        sin = self.sin if sign > 0 else -self.sin
        return torch.cat([x1 * self.cos - x2 * sin, x2 * self.cos + x1 * sin], dim=-1).to(x.dtype)


class _Rotate(torch.autograd.Function):
    """A rotation's gradient is the inverse rotation: nothing is saved for backward but the shared table
    (held by reference, so every layer's q and k share one copy and activation profiles count none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        ctx.rope = rope
        return rope.turn(x, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.rope.turn(grad, -1.0), None


def rotate(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [tokens, heads, dim]`` at ``position_ids`` (restarted per sequence): one-off
    form of ``Rotary`` (the model builds one ``Rotary`` per micro-batch instead)."""
    return Rotary(position_ids, x.shape[-1], theta, x.dtype).apply(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        self.recompute = False        # True: the attention core (kernel + SP exchanges) recomputed in backward
        self.q = nn.Linear(cfg.hidden, cfg.heads * cfg.head_size, bias=False)
        self.kv = nn.Linear(cfg.hidden, 2 * cfg.kv_heads * cfg.head_size, bias=False)
        self.out = nn.Linear(cfg.heads * cfg.head_size, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: Rotary, ctx: AttentionContext) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        q = self.q(x).view(tokens, cfg.heads, cfg.head_size)
        k, v = self.kv(x).view(tokens, 2, cfg.kv_heads, cfg.head_size).unbind(1)
        q, k = rope.apply(q), rope.apply(k)
        if self.recompute and torch.is_grad_enabled():
            core = checkpoint(sp_attention, q, k, v, ctx, use_reentrant=False)
        else:
            core = sp_attention(q, k, v, ctx)
        return self.out(core.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.recompute = "none"
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def set_recompute(self, mode: str) -> None:
        self.recompute = check_recompute(mode)
        self.attn.recompute = self.recompute == "selective"

    def forward(self, x: torch.Tensor, rope: Rotary, ctx: AttentionContext) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():   # keep only the layer's input for backward
            return checkpoint(self._forward, x, rope, ctx, use_reentrant=False)
        return self._forward(x, rope, ctx)

    def _forward(self, x: torch.Tensor, rope: Rotary, ctx: AttentionContext) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, ctx)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Decoder-only LM over a flat token shard: ``input_ids [tokens]`` -> ``logits [tokens, vocab]``.

    ``shard_loss`` (the ``SPModel`` entry the executor uses) never materialises all logits: it calls
    ``fused_loss.lm_head_loss`` with ``loss_kernel`` (None: "auto", a fused library kernel on CUDA where it
    can serve the call, else FlexSP's own loss in chunks of ``loss_chunk_tokens``, None: a memory budget,
    ``loss.default_chunk``); ``forward`` returns all logits (tests, inference).
    """

    def __init__(self, cfg: ModelSpec, *, loss_chunk_tokens: int | None = None, loss_kernel: str | None = None,
                 recompute: str | Sequence[str] = "none") -> None:
        super().__init__()
        self.cfg = check_spec(cfg)
        self.loss_chunk_tokens, self.loss_kernel = loss_chunk_tokens, loss_kernel
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.apply(_init)
        self.set_recompute(recompute)

    def set_recompute(self, recompute: str | Sequence[str]) -> None:
        """Activation checkpointing per layer: "none", "selective" (attention core recomputed in backward)
        or "full" (the whole layer); one mode for all layers or one per layer. The cost model's capacity
        reads the same setting (``flexsp.plan.memory.activation_bytes_per_token``)."""
        modes = [recompute] * len(self.blocks) if isinstance(recompute, str) else list(recompute)
        if len(modes) != len(self.blocks):
            raise ValueError(f"recompute needs one mode per layer ({len(self.blocks)}), got {len(modes)}")
        for block, mode in zip(self.blocks, modes):
            block.set_recompute(mode)

    # --- SPModel ------------------------------------------------------------------------------
    def sp_heads(self) -> tuple[int, int]:
        return self.cfg.heads, self.cfg.kv_heads

    def fsdp_units(self) -> Sequence[nn.Module]:
        return list(self.blocks)

    def shard_loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                   ctx: AttentionContext) -> torch.Tensor:
        """Summed next-token cross-entropy of this shard (fp32 or wider), the LM head fused with the loss and
        its backward (``fused_loss.lm_head_loss``)."""
        hidden = self.hidden_states(input_ids, position_ids, ctx)
        head = self.embed if self.lm_head is None else self.lm_head
        return lm_head_loss(hidden, head.weight, getattr(head, "bias", None), labels, self.loss_chunk_tokens,
                            self.loss_kernel)

    # --- plain use ----------------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      ctx: AttentionContext | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[tokens, hidden]``. Without ``ctx`` the tokens are one causal sequence."""
        if ctx is None:
            ctx = AttentionContext.single(input_ids.numel(), device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(input_ids.numel(), device=input_ids.device)
        x = self.embed(input_ids)
        rope = Rotary(position_ids, self.cfg.head_size, self.cfg.rope_theta, x.dtype)   # once, for every layer
        for block in self.blocks:
            x = block(x, rope, ctx)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                ctx: AttentionContext | None = None) -> torch.Tensor:
        """All logits of the shard (in the parameters' dtype)."""
        return self._project(self.hidden_states(input_ids, position_ids, ctx))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed.weight) if self.lm_head is None else self.lm_head(hidden)


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
