"""Next-token cross-entropy through the LM head, a chunk of tokens at a time.

``[tokens, vocab]`` fp32 logits are the largest activation of a long shard (32K tokens x 128K vocab
is 16 GiB). ``linear_cross_entropy`` computes, per chunk, the logits, the loss and at once their
gradients with respect to the hidden states and the head's weight (softmax - one-hot), and keeps
only those gradients: peak extra memory is one chunk's logits, and backward is a multiply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsp.runtime.sp.context import IGNORE_INDEX

CHUNK_BYTES = 256 * 2**20   # fp32 logits per chunk


def default_chunk(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """SUM over tokens with ``labels != -100`` of ``cross_entropy(hidden @ weight.T + bias, labels)``.

    ``hidden [tokens, h]``, ``weight [vocab, h]``, ``labels [tokens]``. Logits are computed in the
    head's dtype and reduced in fp32 (fp64 when the model is fp64); the result has that dtype.
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [tokens, h] and labels [tokens], got {tuple(hidden.shape)} "
                         f"and {tuple(labels.shape)}")
    chunk = int(chunk_tokens or default_chunk(weight.shape[0]))
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = F.linear(h, weight, bias).to(acc)
            valid = y != IGNORE_INDEX
            target = y.masked_fill(~valid, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None])[:, 0]
            total += ((lse - picked) * valid).sum()
            if not (need_h or need_w or need_b):
                continue
            grad = torch.exp(logits.sub_(lse[:, None]))           # softmax, in place of the logits
            grad.scatter_add_(1, target[:, None], -valid[:, None].to(acc))
            grad.mul_(valid[:, None])
            g = grad.to(hidden.dtype)
            if need_h:
                grad_h[start:start + chunk] = g @ weight.to(hidden.dtype)
            if need_w:
                grad_w += (g.t() @ h).to(acc)
            if need_b:
                grad_b += grad.sum(0)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_b) if t is not None))
        ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        grads = []
        for present, dtype in zip(ctx.present, ctx.dtypes):
            grads.append((next(saved) * grad_out).to(dtype) if present else None)
        return grads[0], grads[1], grads[2], None, None
