"""Next-token cross-entropy through the LM head, fused with its backward, a chunk of tokens at a time.

``[tokens, vocab]`` fp32 logits are the largest activation of a long shard (32K tokens x 128K vocab is
16 GiB). ``linear_cross_entropy`` computes, chunk by chunk in forward, the logits, the loss and at once
the loss's gradients: d loss / d logits = softmax - one-hot (zero on ``IGNORE_INDEX`` rows), then the
gradients with respect to the hidden states (``g @ W``), the head's weight (``g^T h``) and bias
(``sum g``). It keeps those and frees the chunk's logits. Backward only scales the kept gradients by
the incoming gradient (the loss is linear in nothing else: a scalar's gradient is a scale).

Against ``F.linear`` + ``F.cross_entropy`` on the whole shard: the same three matmuls, no recompute
(the checkpointed chunks this replaces ran the head's forward matmul twice), one exp pass over the
logits instead of two (log-softmax, then softmax in backward), and logits memory O(chunk x vocab).
The price: the gradients exist from forward on (``[tokens, hidden]`` + ``[vocab, hidden]`` in fp32),
and they are computed even if backward never runs (call it under ``torch.no_grad()`` to skip them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsp.runtime.sp.context import IGNORE_INDEX

CHUNK_BYTES = 256 * 2**20   # fp32 logits per chunk


def default_chunk(vocab: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """SUM over tokens with ``labels != IGNORE_INDEX`` of ``cross_entropy(hidden @ weight.T + bias, labels)``.

    ``hidden [tokens, h]``, ``weight [vocab, h]`` (an LM head's, or a tied embedding's), ``labels
    [tokens]``. The matmuls run in the compute dtype (autocast's where autocast is on, else the inputs'
    promoted dtype); the softmax and the sum in fp32 (fp64 when the inputs are fp64), which is the result's
    dtype. Gradients come back in each input's own dtype (fp32 master weights under autocast).
    """
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be [tokens, h], weight [vocab, h] and labels [tokens], got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}")
    chunk = int(chunk_tokens or default_chunk(weight.shape[0]))
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device = hidden.device.type
    compute = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
               else torch.promote_types(hidden.dtype, weight.dtype))
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk, compute, torch.is_grad_enabled())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, compute, grad_enabled):
        acc = torch.promote_types(compute, torch.float32)
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        need_b = grad_enabled and bias is not None and ctx.needs_input_grad[2]
        with torch.autocast(hidden.device.type, enabled=False):   # dtypes are explicit below
            w = weight.to(compute)
            b = None if bias is None else bias.to(compute)
            total = torch.zeros((), dtype=acc, device=hidden.device)
            grad_h = torch.empty_like(hidden) if need_h and hidden.dtype == compute else None
            pieces = []                              # autocast: bf16 chunks of an fp32 hidden gradient, cast once
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            grad_b = torch.zeros(weight.shape[:1], dtype=acc, device=weight.device) if need_b else None
            for start in range(0, hidden.shape[0], chunk):
                n = min(chunk, hidden.shape[0] - start)
                h, y = hidden.narrow(0, start, n).to(compute), labels.narrow(0, start, n)
                z = F.linear(h, w, b).to(acc)          # a copy for bf16 logits; the fp32 logits themselves otherwise
                valid = y.ne(IGNORE_INDEX)             # function-form ops: fake CUDA also refuses ~ and [:, None]
                keep = valid.unsqueeze(1)
                target = torch.where(valid, y, 0).unsqueeze(1)
                picked = z.gather(1, target).squeeze(1)
                top = z.amax(dim=1)
                z.sub_(top.unsqueeze(1)).exp_()          # one exp pass serves the loss and its gradient
                norm = z.sum(dim=1)
                total += ((norm.log() + top - picked) * valid).sum()
                if not (need_h or need_w or need_b):
                    continue
                z.div_(norm.unsqueeze(1))                # softmax
                z.scatter_add_(1, target, keep.to(acc).neg())
                z.mul_(keep)                             # ignored targets add no gradient
                g = z.to(compute)
                if need_h:
                    if grad_h is not None:
                        torch.mm(g, w, out=grad_h.narrow(0, start, n))   # in place: no copy
                    else:
                        pieces.append(g @ w)
                if need_w:
                    if g.dtype == acc:
                        grad_w.addmm_(g.t(), h)
                    else:
                        grad_w += (g.t() @ h).to(acc)
                if need_b:
                    grad_b += z.sum(dim=0)
        if need_h and grad_h is None:
            grad_h = torch.cat(pieces).to(hidden.dtype) if pieces else torch.zeros_like(hidden)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_b) if t is not None))
        ctx.present = (need_h, need_w, need_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_out).to(dtype) if present else None
                 for present, dtype in zip(ctx.present, ctx.dtypes)]
        return grads[0], grads[1], grads[2], None, None, None, None
