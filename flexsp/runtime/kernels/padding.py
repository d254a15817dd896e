"""The padding contract, enforced in one place.

A kernel's contract here is: rows outside ``cu_seqlens`` are *unspecified*. Queries past
``cu_seqlens_q[-1]`` and keys/values past ``cu_seqlens_k[-1]`` are padding (``pack`` pads every group's
stream to a multiple of its degree), and a kernel may leave anything in them - in its output, its lse,
and in the q/k/v gradients its backward writes (torch's ``varlen_attn`` backward leaves uninitialised
memory there on an H200; at degree > 1 that reached the weight gradients). ``Rows`` turns that into
exact zeros for every caller:

* ``Rows.guard(q, k, v)`` before a differentiable kernel call: identity forward; backward zeroes the
  gradient rows outside the bounds, so whatever the kernel's backward wrote there never reaches q, k, v.
* ``Rows.output(out)`` after it: zero output rows outside the bounds (no gradient flows into them).
* ``Rows.partial(out, lse)`` for the log-sum-exp forms: rows outside the bounds, and rows whose lse is
  not finite (no key: FA2 writes ``+inf``; NaN from a kernel), become ``(0, -inf)``.
* ``Rows.grads(dq, dk, dv)`` for the hand-written backward the ring calls (``lse_backward``).

Every mask is ``torch.where`` (or ``masked_fill``, the same selection) on a ``[tokens]`` bool built on the device from the device bounds
(``arange < cu[-1]``) or a host int, never a multiply (``0 * NaN`` is NaN) and never a host read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


def real_rows(cu: torch.Tensor | Sequence[int], tokens: int, device: torch.device) -> torch.Tensor:
    """``[tokens]`` bool on ``device``: the row lies before the last bound (host ints or a device tensor)."""
    pos = torch.arange(tokens, device=device)
    if isinstance(cu, torch.Tensor):
        # function-form ops, not ``[]``: Python indexing takes a device guard, which fake CUDA tensors cannot
        return pos < cu.select(0, cu.numel() - 1).to(device)
    return pos < int(cu[-1])


class _ZeroOutside(torch.autograd.Function):
    """Identity; the gradient of the rows outside ``real`` is exactly zero whatever arrives there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(real)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (real,) = ctx.saved_tensors
        return keep_rows(real, grad), None


def keep_rows(real: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` with its rows outside ``real`` set to exactly zero (``where``: NaN there is dropped too)."""
    return torch.where(real.view(-1, *([1] * (x.dim() - 1))), x, 0.0)


def guard_rows(real: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` unchanged, except that their gradients outside ``real`` come back exactly zero: put in front of
    a kernel whose backward may leave those rows unwritten."""
    if not torch.is_grad_enabled():
        return xs
    return tuple(_ZeroOutside.apply(x, real) if x.requires_grad else x for x in xs)


@dataclass(frozen=True, eq=False)
class Rows:
    """Which rows of q (``q``) and of k/v (``k``) lie inside their bounds: ``[tokens]`` bool masks."""

    q: torch.Tensor
    k: torch.Tensor

    @classmethod
    def of(cls, cu_q: torch.Tensor | Sequence[int], tokens_q: int, device: torch.device,
           cu_k: torch.Tensor | Sequence[int] | None = None, tokens_k: int | None = None) -> "Rows":
        """Masks from the bounds; ``cu_k`` None: the keys share the queries' bounds (``attend``)."""
        rq = real_rows(cu_q, tokens_q, device)
        if cu_k is None and (tokens_k is None or tokens_k == tokens_q):
            return cls(rq, rq)
        return cls(rq, real_rows(cu_q if cu_k is None else cu_k, tokens_q if tokens_k is None else tokens_k, device))

    def guard(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``(q, k, v)`` unchanged, except that their gradients outside the bounds come back zero."""
        return (*guard_rows(self.q, q), *guard_rows(self.k, k, v))

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return keep_rows(self.q, out)

    def partial(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [tq, heads, dim], lse [heads, tq])`` with every row that saw no key (padding, no key,
        a non-finite lse) set to ``(0, -inf)``."""
        live = self.q.unsqueeze(0) & torch.isfinite(lse)
        # masked_fill is where(mask, 0, out) that keeps ``out``'s (contiguous) layout; the mask is transposed
        return out.masked_fill(live.t().unsqueeze(-1).logical_not(), 0.0), torch.where(live, lse, -math.inf)

    def grads(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        return keep_rows(self.q, dq), keep_rows(self.k, dk), keep_rows(self.k, dv)


def contained(kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``kernel(q, k, v)`` (differentiable through the kernel's own backward) under the contract:
    exactly zero output and q/k/v gradient outside the bounds."""
    q, k, v = rows.guard(q, k, v)
    return rows.output(kernel(q, k, v))
