"""Attention sinks (GPT-OSS, Granite-SWA): one learned logit per head added to every softmax denominator.

A sink is a key every query sees with score ``sink[h]`` and a zero value, so it never needs a kernel of
its own: from any kernel's ``(out, lse)`` over the real keys,

    out' = out * sigmoid(lse - sink),        lse' = logaddexp(lse, sink)

exactly (``out`` is ``sum_j p_j v_j`` normalised by ``e^lse``; the sink adds ``e^sink`` to the
normaliser). The ring applies it once, to the merged statistics of the whole sequence.

* ``with_sinks`` is that map in differentiable torch ops (the gradient reaches ``sink`` and, through
  ``lse``, q and k).
* ``sink_stats`` / ``sink_grad`` are the no-autograd pair for hand-written backwards (the ring's): the
  q/k/v gradient of the attention *with* the sink is the ordinary FlashAttention recurrence run on the
  augmented ``out'``/``lse'`` (the sink's value is zero, so ``D = rowsum(dO * out')`` is unchanged), and
  ``d sink[h] = -sum_i exp(sink[h] - lse'_i) * D_i``.

Rows that saw no key (padding: ``lse = -inf``) keep ``(0, -inf)`` and add nothing to the sink's gradient.
"""
from __future__ import annotations

import math

import torch

from flexsp.runtime.kernels.layout import AttentionError


def check_sinks(sinks: torch.Tensor, heads: int) -> None:
    if sinks.dim() != 1 or sinks.shape[0] != heads:
        raise AttentionError(f"attention sinks must be one logit per query head, [{heads}], got {tuple(sinks.shape)}")


def _live(lse: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(lse)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [tq, heads, dim], lse [heads, tq])`` with the sink added; differentiable in all three."""
    check_sinks(sinks, lse.shape[0])
    sink = sinks.to(lse.dtype)[:, None]
    live = _live(lse)
    safe = torch.where(live, lse, sink)                     # no -inf reaches the ops: no NaN in their backward
    weight = torch.where(live, torch.sigmoid(safe - sink), 0.0)
    merged = torch.where(live, torch.logaddexp(safe, sink.expand_as(safe)), -math.inf)
    return (out * weight.t().unsqueeze(-1).to(out.dtype)), merged


@torch.no_grad()
def sink_stats(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_sinks`` without autograd: the augmented statistics a hand-written backward saves."""
    return with_sinks(out, lse, sinks.detach())


@torch.no_grad()
def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sink [heads]`` from the augmented ``out``/``lse`` and the output's gradient."""
    ct = lse.dtype
    delta = (dout.to(ct) * out.to(ct)).sum(-1).t()                         # [heads, tq]
    live = _live(lse)
    p_sink = torch.where(live, torch.exp(sinks.to(ct)[:, None] - torch.where(live, lse, 0.0)), 0.0)
    return -(p_sink * torch.where(live, delta, 0.0)).sum(-1).to(sinks.dtype)
