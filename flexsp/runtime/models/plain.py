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


def _sequence_loss(model: TinyLM, ids: torch.Tensor) -> torch.Tensor:
    cfg, s = model.cfg, ids.numel()
    x = model.embed(ids)
    rope = Rotary(torch.arange(s, device=ids.device), cfg.head_size, cfg.rope_theta, x.dtype)
    for block in model.blocks:
        attn = block.attn
        h = block.attn_norm(x)
        q = rope.apply(attn.q(h).view(s, cfg.heads, cfg.head_size))
        k, v = attn.kv(h).view(s, 2, cfg.kv_heads, cfg.head_size).unbind(1)
        k = rope.apply(k)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, enable_gqa=cfg.kv_heads != cfg.heads)
        x = x + attn.out(out[0].transpose(0, 1).reshape(s, -1))
        x = x + block.mlp(block.mlp_norm(x))
    logits = model._project(model.norm(x))
    return F.cross_entropy(logits[:-1].to(loss_dtype(logits.dtype)), ids[1:], reduction="sum")


def plain_loss(model: TinyLM, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over ``sequences`` (1-D token tensors), one forward per sequence."""
    labels = sum(max(0, int(seq.numel()) - 1) for seq in sequences)
    return sum(_sequence_loss(model, seq) for seq in sequences) / labels
