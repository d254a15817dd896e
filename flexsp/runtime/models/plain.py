"""The plain loop a user writes today, on a ``TinyLM``'s own weights: what the degree-1 step must not lose to.

One sequence at a time, ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on 4-D
``[1, heads, s, dim]`` tensors (the layout that dispatches SDPA's fused kernels), no packing, no
context, no FSDP. ``plain_loss`` returns the same quantity ``StepExecutor`` minimises - the summed
next-token cross-entropy over the batch divided by its labelled tokens - so a step of each from the
same weights must agree to rounding. ``experiments/step_benchmark.py`` and ``flexsp selftest`` time
the executor against it; the tests count its Python calls per layer.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from flexsp.runtime.models.protocol import loss_dtype
from flexsp.runtime.models.tiny import Rotary, TinyLM


def _logits(model: TinyLM, ids: torch.Tensor, positions: torch.Tensor, **sdpa: object) -> torch.Tensor:
    """The model's layers written out with one ``F.scaled_dot_product_attention`` call per layer on 4-D
    ``[1, heads, tokens, dim]`` tensors; ``sdpa`` picks the masking (``is_causal`` or ``attn_mask``)."""
    cfg, n = model.cfg, ids.numel()
    x = model.embed(ids)
    rope = Rotary(positions, cfg.head_size, cfg.rope_theta, x.dtype)
    for block in model.blocks:
        attn = block.attn
        h = block.attn_norm(x)
        q = rope.apply(attn.q(h).view(n, cfg.heads, cfg.head_size))
        k, v = attn.kv(h).view(n, 2, cfg.kv_heads, cfg.head_size).unbind(1)
        k = rope.apply(k)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             **sdpa)
        x = x + attn.out(out[0].transpose(0, 1).reshape(n, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return model._project(model.norm(x))


def _sequence_loss(model: TinyLM, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg
    logits = _logits(model, ids, torch.arange(ids.numel(), device=ids.device), is_causal=True,
                     enable_gqa=cfg.kv_heads != cfg.heads)
    return F.cross_entropy(logits[:-1].to(loss_dtype(logits.dtype)), ids[1:], reduction="sum")


def plain_loss(model: TinyLM, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over ``sequences`` (1-D token tensors), one forward per sequence."""
    labels = sum(max(0, int(seq.numel()) - 1) for seq in sequences)
    return sum(_sequence_loss(model, seq) for seq in sequences) / labels


def masked_loss(model: TinyLM, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """The same loss with the whole pack in one forward: one SDPA call per layer under a 4-D
    block-causal ``[T, T]`` mask (the other way a user packs without FlexSP)."""
    ids = torch.cat(list(sequences))
    seq = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([s.numel() for s in sequences]))
    pos = torch.cat([torch.arange(s.numel()) for s in sequences])
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    logits = _logits(model, ids, pos, attn_mask=mask[None, None], enable_gqa=True)
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in sequences])
    return F.cross_entropy(logits.to(loss_dtype(logits.dtype)), labels, reduction="sum") / sum(s.numel() - 1 for s in sequences)
