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

Chunk size: a memory budget, not a fixed count (``default_chunk``). On CUDA a chunk's logits and their
gradient may take ``CUDA_FREE_FRACTION`` of the free device memory (the driver's free memory plus what
torch's allocator holds unused) up to ``CUDA_CHUNK_BYTES``; on CPU, or where free memory is unknown,
``HOST_CHUNK_BYTES``. The weight gradient is one preallocated accumulator in the accumulation dtype,
added to in place: ``addmm_`` when the matmul dtype is the accumulator's, on CUDA ``addmm(out_dtype=fp32)``
for bf16/fp16 matmuls (bf16 products summed in fp32, no temporary), elsewhere a few vocabulary blocks
whose bf16 products are added one block at a time (a ``[vocab/8, hidden]`` temporary at most). Before
this, each chunk made a ``[vocab, hidden]`` product and its fp32 copy (65 adds of 2 GiB at Llama-3's
vocabulary and 523-token chunks).

On CUDA the LM-head loss of ``TinyLM`` and the HF adapter goes to a field library when it can serve the
call (``flexsp.runtime.models.fused_loss``); this module stays the reference and the fallback.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flexsp.runtime.sp.context import IGNORE_INDEX

CUDA_FREE_FRACTION = 1 / 8          # of free device memory: a chunk's logits and their gradient
CUDA_CHUNK_BYTES = 4 * 2**30        # more buys nothing: a chunk of a few thousand tokens is matmul-bound
HOST_CHUNK_BYTES = 256 * 2**20      # CPU, or a device whose free memory is unknown (fp32: what it always was)
VOCAB_BLOCKS = 8                    # weight-gradient blocks where no out_dtype matmul exists (CPU)
BLOCK_BYTES = 64 * 2**20            # ... and at most this much per block's low-precision product


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's where autocast is on, else the inputs' promoted dtype."""
    device = hidden.device.type
    return (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
            else torch.promote_types(hidden.dtype, weight.dtype))


def chunk_budget(device: torch.device | str | None) -> int:
    """Bytes one chunk's logits (and their gradient) may take on ``device``; see the module docstring."""
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return HOST_CHUNK_BYTES
    try:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except RuntimeError:   # no driver answer (a fake or lost device): the documented cap
        return HOST_CHUNK_BYTES
    return int(min(CUDA_CHUNK_BYTES, (free + max(0, cached)) * CUDA_FREE_FRACTION))


def bytes_per_logit(compute: torch.dtype) -> int:
    """Bytes per ``[token, vocab]`` element of one chunk: the logits in the accumulation dtype, plus the
    matmul's low-precision output and the gradient's low-precision copy when the two dtypes differ."""
    acc = torch.promote_types(compute, torch.float32)
    low = 2 * compute.itemsize if compute != acc else 0
    return acc.itemsize + low


def default_chunk(vocab: int, device: torch.device | str | None = None,
                  compute: torch.dtype = torch.float32) -> int:
    """Tokens per chunk so that one chunk fits ``chunk_budget(device)``."""
    return max(1, chunk_budget(device) // (bytes_per_logit(compute) * max(1, vocab)))


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be [tokens, h], weight [vocab, h] and labels [tokens], got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, chunk_tokens: int | None = None, *, logit_scale: float = 1.0,
                         softcap: float | None = None) -> torch.Tensor:
    """SUM over tokens with ``labels != IGNORE_INDEX`` of ``cross_entropy(hidden @ weight.T + bias, labels)``.

    ``hidden [tokens, h]``, ``weight [vocab, h]`` (an LM head's, or a tied embedding's), ``labels
    [tokens]``. The matmuls run in the compute dtype (autocast's where autocast is on, else the inputs'
    promoted dtype); the softmax and the sum in fp32 (fp64 when the inputs are fp64), which is the result's
    dtype. Gradients come back in each input's own dtype (fp32 master weights under autocast).
    ``chunk_tokens`` None: ``default_chunk`` (a memory budget). ``logit_scale`` multiplies the logits, then
    ``softcap`` caps them (``softcap * tanh(z / softcap)``) before the softmax: Granite's ``logits_scaling``
    and Gemma 2's ``final_logit_softcapping``, computed chunk by chunk like the rest.
    """
    check_inputs(hidden, weight, labels)
    compute = compute_dtype(hidden, weight)
    chunk = int(chunk_tokens or default_chunk(weight.shape[0], hidden.device, compute))
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk, compute, torch.is_grad_enabled(),
                                     float(logit_scale), None if softcap is None else float(softcap))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, compute, grad_enabled, scale=1.0, softcap=None):
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
                if scale != 1.0:
                    z.mul_(scale)
                capped = None
                if softcap is not None:                # keep tanh for the gradient: d cap / d z = 1 - tanh^2
                    capped = torch.tanh(z / softcap)
                    z = capped * softcap
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
                if capped is not None:
                    z.mul_(1 - capped * capped)
                if scale != 1.0:
                    z.mul_(scale)
                g = z.to(compute)
                if need_h:
                    if grad_h is not None:
                        torch.mm(g, w, out=grad_h.narrow(0, start, n))   # in place: no copy
                    else:
                        pieces.append(g @ w)
                if need_w:
                    accumulate_outer(grad_w, g, h)
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
        return grads[0], grads[1], grads[2], None, None, None, None, None, None


def accumulate_outer(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += g.T @ h`` in place, never a temporary of ``acc``'s shape (``acc [vocab, hidden]``, ``g
    [n, vocab]``, ``h [n, hidden]``; ``g`` and ``h`` in one dtype, ``acc`` that dtype or wider)."""
    if g.dtype == acc.dtype:
        acc.addmm_(g.t(), h)
    elif has_out_dtype_matmul(acc.device):   # bf16/fp16 products summed into fp32 by the matmul itself
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:                              # no out_dtype matmul here (CPU): a block of the vocabulary at a time
        vocab, width = acc.shape
        rows = max(1, min(-(-vocab // VOCAB_BLOCKS), BLOCK_BYTES // max(1, width * g.dtype.itemsize)))
        gt = g.t()
        for start in range(0, vocab, rows):
            n = min(rows, vocab - start)
            acc.narrow(0, start, n).add_(torch.mm(gt.narrow(0, start, n), h))


def has_out_dtype_matmul(device: torch.device) -> bool:
    """Whether ``addmm(..., out_dtype=)`` runs on ``device``: CUDA's kernels have it for bf16/fp16 on Ampere
    and newer where the installed torch has the overload (tried once per device on two 2 x 2 matrices, not
    assumed from the version), CPU's have not (torch 2.13), and a fake CUDA tensor of a CPU-only build cannot
    write an ``out=`` it did not allocate."""
    return (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
            and _out_dtype_addmm_runs(torch.device(device).index))


@functools.lru_cache(maxsize=16)
def _out_dtype_addmm_runs(index: int | None) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    try:
        with unset_fake_temporarily():      # real tensors, even when first asked under FakeTensorMode
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=torch.device("cuda", index))
            acc = torch.full((2, 2), 0.5, dtype=torch.float32, device=a.device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            return bool((acc == 2.5).all())     # one host read, once per device
    except (RuntimeError, TypeError, NotImplementedError):
        return False