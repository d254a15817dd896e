"""The LM-head loss the models call: a field library's fused kernel where it can serve the call, FlexSP's
own ``linear_cross_entropy`` otherwise.

On CUDA, liger-kernel's fused linear cross-entropy (Triton; the ``gpu`` extra, ``liger-kernel>=0.8.2,<0.9``:
earlier releases give wrong gradients with ``reduction="none"``, liger #968/#1298)
measured 163 ms for Llama-3's head at 33,792 tokens on an H200 against 239 ms for the project's own loss
at its best chunk (issue 36). It is taken when all of these hold, else the own loss runs:

* the tensors are on a device it runs on (``LIBRARY_DEVICES``: CUDA) and it imports;
* the matmul dtype is bf16, fp16 or fp32 (fp64 reference runs stay on the own loss);
* gradients are wanted and ``hidden`` requires one (the library computes the weight's and bias's gradients
  only alongside the hidden states'; under ``torch.no_grad()`` the own loss skips all of them);
* the shard has tokens.

What the call keeps the same as the own loss: SUM reduction over labels ``!= IGNORE_INDEX``, a tied head (the
weight is any ``[vocab, hidden]`` tensor), a bias, autocast's matmul dtype (the inputs are cast to it here, with
autocast off inside the library, so it sees one dtype), the weight gradient accumulated in fp32 (``accum_dtype``,
where the installed version takes it), an fp32 result,
and gradients in each input's own dtype (the casts' backward: fp32 masters get fp32 gradients). One difference:
the library returns the weight gradient in the matmul dtype (bf16 under autocast), as ``F.linear``'s own
backward under autocast does; the own loss keeps it fp32.

The library synchronises the host twice per call (liger-kernel 0.8.5: it counts labelled tokens with
``.item()`` in forward, and compares the incoming gradient with 1 by ``torch.equal`` in backward). A
host-sync check of FlexSP's code (``flexsp selftest``) wraps its window in ``library_syncs_allowed()``:
then the library's forward and its backward node run with CUDA's sync-debug mode off, and every other
line of the step stays checked.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
from typing import Callable, Iterator

import torch

from flexsp.runtime.models.loss import check_inputs, compute_dtype, linear_cross_entropy
from flexsp.runtime.sp.context import IGNORE_INDEX

KERNELS = ("auto", "liger", "flexsp")     # auto: the library when it can serve the call; liger: it or an error
LIBRARY_DEVICES = frozenset({"cuda"})     # where the library's Triton kernels run
LIBRARY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LIBRARY_MODULE, LIBRARY_FUNCTION = "liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"


_SYNCS_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("flexsp_library_syncs_allowed", default=False)


@contextlib.contextmanager
def library_syncs_allowed() -> Iterator[None]:
    """Inside: the library's own host syncs (forward and backward) run outside CUDA's sync-debug mode."""
    token = _SYNCS_ALLOWED.set(True)
    try:
        yield
    finally:
        _SYNCS_ALLOWED.reset(token)


class _SyncDebugOff:
    """Turns CUDA's sync-debug mode off and back to what it was: around the library's forward call, and as
    pre/post hooks around its backward node (which autograd runs on its own thread, later)."""

    def __init__(self) -> None:
        self.saved = 0

    def off(self, *_: object) -> None:
        self.saved = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)

    def back(self, *_: object) -> None:
        torch.cuda.set_sync_debug_mode(self.saved)


def library_function() -> Callable | None:
    """liger-kernel's functional fused linear cross-entropy, or None where it is not installed (an import
    each call: a dictionary look-up once imported, so a stand-in put in ``sys.modules`` is seen)."""
    try:
        module = importlib.import_module(LIBRARY_MODULE)
    except ImportError:
        return None
    return getattr(module, LIBRARY_FUNCTION, None)


def library_refusal(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    compute: torch.dtype) -> str | None:
    """Why the library cannot serve this call (None: it can). Checked in this order: device, import,
    dtype, gradients, tokens."""
    if hidden.device.type not in LIBRARY_DEVICES:
        return f"device {hidden.device.type} (the library runs on {sorted(LIBRARY_DEVICES)})"
    if library_function() is None:
        return f"{LIBRARY_MODULE}.{LIBRARY_FUNCTION} does not import (pip install 'flexsp[gpu]')"
    if compute not in LIBRARY_DTYPES:
        return f"matmul dtype {compute} (the library takes {[str(d) for d in LIBRARY_DTYPES]})"
    wants = [t.requires_grad for t in (hidden, weight, bias) if t is not None]
    if not torch.is_grad_enabled() or not any(wants):
        return "no gradient wanted (the own loss skips computing them)"
    if not hidden.requires_grad:
        return "a gradient for the head but not the hidden states (the library computes both or neither)"
    if hidden.shape[0] == 0:
        return "an empty shard"
    return None


def choose_kernel(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  kernel: str | None = None) -> tuple[str, str | None]:
    """``("liger" | "flexsp", why the library was not taken or None)`` for this call."""
    kernel = kernel or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"loss kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "flexsp":
        return "flexsp", "asked for"
    reason = library_refusal(hidden, weight, bias, compute_dtype(hidden, weight))
    if reason is not None and kernel == "liger":
        raise ValueError(f"loss kernel 'liger' cannot serve this call: {reason}; use 'auto' to fall back")
    return ("flexsp", reason) if reason is not None else ("liger", None)


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                 chunk_tokens: int | None = None, kernel: str | None = None, *, logit_scale: float = 1.0,
                 softcap: float | None = None) -> torch.Tensor:
    """The quantity ``linear_cross_entropy`` computes (summed next-token loss, fp32 or wider), by the kernel
    ``choose_kernel`` picks. ``chunk_tokens`` sizes the own loss's chunks; the library chunks by itself.
    ``logit_scale``/``softcap`` (the model's logit scaling and final softcap) run on the own loss: the
    library is not asked to reproduce them."""
    check_inputs(hidden, weight, labels)
    transformed = logit_scale != 1.0 or softcap is not None
    if transformed and kernel == "liger":
        raise ValueError("loss kernel 'liger' cannot serve this call: the model scales or soft-caps its logits; "
                         "use 'auto' to fall back")
    name, _ = ("flexsp", "logit transform") if transformed else choose_kernel(hidden, weight, bias, kernel)
    if name == "flexsp":
        return linear_cross_entropy(hidden, weight, bias, labels, chunk_tokens, logit_scale=logit_scale,
                                    softcap=softcap)
    return _library_loss(hidden, weight, bias, labels)


def _library_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  labels: torch.Tensor) -> torch.Tensor:
    fn = library_function()
    compute = compute_dtype(hidden, weight)
    acc = torch.promote_types(compute, torch.float32)
    options = {"ignore_index": IGNORE_INDEX, "reduction": "sum"}
    if "accum_dtype" in inspect.signature(fn).parameters:   # fp32 weight-gradient sums (liger >= 0.8.2 has them)
        options["accum_dtype"] = acc
    quiet = _SyncDebugOff() if _SYNCS_ALLOWED.get() and torch.cuda.get_sync_debug_mode() != 0 else None
    with torch.autocast(hidden.device.type, enabled=False):   # one dtype in; the casts carry gradients back
        args = (hidden.to(compute).contiguous(), weight.to(compute), labels.contiguous())
        bias = None if bias is None else bias.to(compute)
        if quiet is not None:
            quiet.off()
        try:
            loss = fn(*args, bias=bias, **options)
        finally:
            if quiet is not None:
                quiet.back()
    if quiet is not None and loss.grad_fn is not None:
        loss.grad_fn.register_prehook(quiet.off)
        loss.grad_fn.register_hook(quiet.back)
    return loss.to(acc)
