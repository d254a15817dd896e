"""Local attention over packed sequences, and the log-sum-exp form the ring axis merges.

Two entry points share one set of kernels:

* ``attend(q, k, v, cu_seqlens, *, max_seqlen)`` - causal within each packed sequence, never across.
* ``attend_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal)`` -
  queries and keys with their own bounds (sequence ``i`` of q attends to sequence ``i`` of k), returning
  ``(out, lse)`` so partial results over disjoint key sets combine exactly with ``merge_partials``.
  Differentiable through both outputs.

Kernels (``backend=``): ``varlen`` - ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 in
torch; CUDA, fp16/bf16); ``flash`` - the optional flash-attn package (``attend`` only; ``attend_lse``
runs the same FA2 maths through ``varlen``); ``sdpa`` - any device and dtype: ``attend`` makes ONE
SDPA call under a block-diagonal causal mask built on the device from ``cu_seqlens``, ``attend_lse``
writes that masked softmax out (SDPA has no public lse output); ``reference`` - an explicit softmax per
sequence (a Python loop; tests only). ``auto`` = ``varlen`` on CUDA in half precision, else ``sdpa``.

Layouts: ``q [tokens, heads, dim]``, ``k``/``v`` ``[tokens_k, kv_heads, dim]`` with heads % kv_heads == 0
(query head ``h`` uses kv head ``h // (heads // kv_heads)``). ``cu_seqlens`` is ``[n+1]`` int bounds: a
tuple, or an int32 tensor on q's device - then nothing here reads it on the host (no ``.tolist()``,
``.item()``; ``max_seqlen`` must be given), so a CUDA step never waits on the GPU. Tokens past
``cu_seqlens[-1]`` are padding: their output is zero, their lse ``-inf``, and they get no gradient.
``lse`` is ``[heads, tokens_q]``, float32 (float64 for float64 inputs); a row that attends to no key
has ``out = 0`` and ``lse = -inf``. With ``causal`` and unequal q/k lengths the mask is bottom-right
aligned (flash-attn's convention): query ``i`` of ``Lq`` sees key ``j`` of ``Lk`` iff ``Lk - j >= Lq - i``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from flexsp.errors import FlexSPError

try:  # optional: only on GPU machines with flash-attn built
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match the installed torch
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
except Exception:  # an older torch
    AuxRequest = varlen_attn = None

BACKENDS = ("auto", "varlen", "flash", "sdpa", "sdpa_each", "reference")
Bounds = Sequence[int] | torch.Tensor


class AttentionError(FlexSPError):
    """Attention inputs do not fit together (shapes, bounds, backend)."""


# --- backend choice -------------------------------------------------------------------------------
def flash_available(device: torch.device | str | None = None) -> bool:
    """flash-attn is importable and a CUDA device is there to run it."""
    if flash_attn_varlen_func is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def varlen_available(device: torch.device | str | None = None) -> bool:
    """torch's own varlen FlashAttention can run (CUDA present, torch new enough)."""
    if varlen_attn is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """``auto`` -> ``varlen`` when it can run on ``q`` (CUDA, half precision), otherwise ``sdpa``."""
    if backend not in BACKENDS:
        raise AttentionError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    half = q.dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        return "varlen" if half and varlen_available(q.device) else "sdpa"
    if backend == "flash" and not flash_available(q.device):
        raise AttentionError("attention backend 'flash' needs flash_attn installed and CUDA tensors; "
                             "use backend='sdpa' or 'auto'")
    if backend == "varlen" and not (varlen_available(q.device) and half):
        raise AttentionError("attention backend 'varlen' needs CUDA tensors in float16/bfloat16 (torch's "
                             "varlen_attn); use backend='sdpa' or 'auto'")
    return backend


# --- input checks (host metadata only) ----------------------------------------------------------
def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_tokens: bool) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise AttentionError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [tokens, heads, dim]")
    if k.shape != v.shape or k.shape[2] != q.shape[2] or (same_tokens and k.shape[0] != q.shape[0]):
        want = f"[{q.shape[0]}, kv_heads, {q.shape[2]}]" if same_tokens else f"[tokens_k, kv_heads, {q.shape[2]}]"
        raise AttentionError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be {want}")
    if q.shape[1] % k.shape[1]:
        raise AttentionError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")


def _bounds_tensor(cu: Bounds, tokens: int, device: torch.device, name: str) -> torch.Tensor:
    """``cu`` as an int32 tensor on ``device``; values are checked only where that costs no device sync."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in (torch.int32, torch.int64):
            raise AttentionError(f"{name} must be a 1-D int32 tensor of sequence bounds, got {cu.dtype} "
                                 f"{tuple(cu.shape)}")
        if cu.device.type == "cpu":          # reading a CPU tensor is free; a device tensor is trusted
            _check_bounds([int(b) for b in cu.tolist()], tokens, name)
        return cu.to(device=device, dtype=torch.int32)
    bounds = [int(b) for b in cu]
    _check_bounds(bounds, tokens, name)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _check_bounds(bounds: list[int], tokens: int, name: str) -> None:
    if not bounds or bounds[0] != 0 or any(nxt < cur for cur, nxt in zip(bounds, bounds[1:])) or bounds[-1] > tokens:
        raise AttentionError(f"{name} must rise from 0 to at most {tokens} tokens, got {bounds}")


def _max_len(cu: Bounds, given: int | None, name: str) -> int:
    if given is not None:
        return int(given)
    if isinstance(cu, torch.Tensor) and cu.device.type != "cpu":
        raise AttentionError(f"{name} is required with device cu_seqlens (reading it would sync the host)")
    bounds = [int(b) for b in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)


# --- masks built on the device ------------------------------------------------------------------
def _segments(cu: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its sequence index (``n`` for padding past ``cu[-1]``) and its distance to that end."""
    n = cu.numel() - 1
    pos = torch.arange(tokens, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu, pos, right=True) - 1            # last bound <= pos: skips empty sequences
    end = cu[(seq + 1).clamp(max=n)]
    return seq, end - pos


def block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens_q: int, tokens_k: int, causal: bool) -> torch.Tensor:
    """``[tokens_q, tokens_k]`` bool: query i may attend key j (same sequence, causal bottom-right)."""
    if cu_q.numel() != cu_k.numel():
        raise AttentionError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    seq_q, to_end_q = _segments(cu_q, tokens_q)
    seq_k, to_end_k = _segments(cu_k, tokens_k)
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q < cu_q.numel() - 1)[:, None]
    if causal:
        allowed &= to_end_k[None, :] >= to_end_q[:, None]
    return allowed


def _real_rows(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    return torch.arange(tokens, device=cu.device, dtype=cu.dtype) < cu[-1]


# --- attend: causal, one packed stream ----------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Bounds, *,
           max_seqlen: int | None = None, backend: str = "auto", scale: float | None = None) -> torch.Tensor:
    """Causal attention per packed sequence; returns ``[tokens, heads, dim]`` like ``q``."""
    _check_shapes(q, k, v, same_tokens=True)
    kernel = resolve_backend(backend, q)
    tokens, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if kernel == "reference":
        return reference(q, k, v, cu_seqlens, scale=scale)
    if kernel == "sdpa_each":
        return _sdpa_each(q, k, v, cu_seqlens, scale)
    cu = _bounds_tensor(cu_seqlens, tokens, q.device, "cu_seqlens")
    real = _real_rows(cu, tokens)[:, None, None]
    if kernel == "sdpa":
        allowed = block_mask(cu, cu, tokens, tokens, causal=True)
        allowed |= torch.eye(tokens, dtype=torch.bool, device=q.device) & ~real[:, :, 0]   # padding sees itself
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=allowed, scale=scale,
                                             enable_gqa=k.shape[1] != heads).transpose(0, 1)
    else:
        max_seqlen = _max_len(cu_seqlens, max_seqlen, "max_seqlen")
        if kernel == "varlen":
            out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0),
                              enable_gqa=k.shape[1] != heads)
        else:  # flash-attn reads kv head h // (heads / kv_heads) itself, like varlen_attn's enable_gqa
            out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    return torch.where(real, out, out.new_zeros(()))   # padding rows: zero output, no gradient


def _sdpa_each(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Bounds, scale: float) -> torch.Tensor:
    """One causal SDPA call per sequence: the work of a varlen kernel (sum of s^2, not the packed
    stream's T^2 that the block-diagonal ``sdpa`` pays), at the price of reading the bounds on the host
    and a Python loop per layer. For measuring compute on a CPU (``flexsp profile``, ``flexsp replay``);
    ``auto`` never picks it."""
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    _check_bounds(bounds, q.shape[0], "cu_seqlens")
    gqa = k.shape[1] != q.shape[1]
    parts = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                            is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    pad = q.shape[0] - bounds[-1]
    if pad:
        parts.append(q.new_zeros(pad, q.shape[1], q.shape[2]))
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Bounds,
              cu_seqlens_k: Bounds | None = None, *, causal: bool = True, scale: float | None = None,
              return_lse: bool = False):
    """Explicit softmax, one sequence at a time (tests only: a Python loop that reads the bounds)."""
    host = lambda cu: [int(b) for b in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]  # noqa: E731
    bq = host(cu_seqlens_q)
    bk = bq if cu_seqlens_k is None else host(cu_seqlens_k)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.promote_types(q.dtype, torch.float32),
                     device=q.device)
    for i in range(len(bq) - 1):
        (qa, qb), (ka, kb) = (bq[i], bq[i + 1]), (bk[i], bk[i + 1])
        scores = torch.einsum("qhd,khd->hqk", q[qa:qb], k[ka:kb]).to(lse.dtype) * scale
        if causal:
            lq, lk = qb - qa, kb - ka
            seen = (lk - torch.arange(lk, device=q.device))[None, :] >= (lq - torch.arange(lq, device=q.device))[:, None]
            scores = scores.masked_fill(~seen, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)                                   # [h, lq]
        probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[qa:qb] = torch.einsum("hqk,khd->qhd", probs, v[ka:kb].to(lse.dtype)).to(q.dtype)
        lse[:, qa:qb] = row_lse
    return (out, lse) if return_lse else out


# --- attend_lse: partial attention for the ring ---------------------------------------------------
def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Bounds, cu_seqlens_k: Bounds, *,
               max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool,
               backend: str = "auto", scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [tokens_q, heads, dim], lse [heads, tokens_q])``; see the module docstring for the rules."""
    _check_shapes(q, k, v, same_tokens=False)
    kernel = resolve_backend(backend, q)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if kernel == "reference":
        return reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, return_lse=True)
    cu_q = _bounds_tensor(cu_seqlens_q, q.shape[0], q.device, "cu_seqlens_q")
    cu_k = _bounds_tensor(cu_seqlens_k, k.shape[0], q.device, "cu_seqlens_k")
    if cu_q.numel() != cu_k.numel():
        raise AttentionError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    spec = LseSpec(cu_q, cu_k, _max_len(cu_seqlens_q, max_seqlen_q, "max_seqlen_q"),
                   _max_len(cu_seqlens_k, max_seqlen_k, "max_seqlen_k"), bool(causal), scale,
                   "varlen" if kernel in ("varlen", "flash") else "sdpa")
    return _AttendLse.apply(q, k, v, spec)


@dataclass(frozen=True, eq=False)
class LseSpec:
    """Everything but the tensors that one partial-attention call needs (bounds, maxima, mask, kernel)."""

    cu_q: torch.Tensor          # int32 bounds of the query sequences
    cu_k: torch.Tensor          # int32 bounds of the key sequences (same count)
    max_q: int
    max_k: int
    causal: bool
    scale: float
    kernel: str                 # "varlen" or "sdpa" (the dense masked path)


def lse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """No-autograd partial attention: ``(out, lse)`` with the conventions of ``attend_lse``."""
    if spec.kernel == "varlen":
        return _varlen_forward(q, k, v, spec)
    return _dense_forward(q, k, v, spec)


def lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, spec: LseSpec, dlse: torch.Tensor | None = None):
    """Gradients ``(dq, dk, dv)`` of one partial call, given the softmax statistics ``out``/``lse``.

    With the partial's own ``out``/``lse`` this is its exact backward. With the *merged* ``out``/``lse``
    of several partials over disjoint keys (and ``dlse`` None) it is this partial's share of the
    merged attention's gradient - how the ring's backward works (FlashAttention's recurrence:
    ``dS = P * (dP - D)``, ``D = rowsum(dO * O)``, ``P = exp(S - lse)``). ``dlse`` adds ``dS += dlse * P``.
    """
    if spec.kernel == "varlen":
        return _varlen_backward(dout, q, k, v, out, lse, spec, dlse)
    return _dense_backward(dout, q, k, v, out, lse, spec, dlse)


class _AttendLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec):
        out, lse = lse_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = lse_backward(dout, q, k, v, out, lse, ctx.spec, dlse)
        return dq, dk, dv, None


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros((), dtype=lse.dtype, device=lse.device), lse)


def _dense_scores(q, k, spec: LseSpec):
    tq, heads, dim = q.shape
    tk, kv_heads, _ = k.shape
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(ct).view(tq, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("qkgd,tkd->kgqt", qg, k.to(ct)) * spec.scale          # [kv_heads, group, tq, tk]
    allowed = block_mask(spec.cu_q, spec.cu_k, tq, tk, spec.causal)
    return scores.masked_fill(~allowed, -math.inf), qg, ct


def _dense_forward(q, k, v, spec: LseSpec):
    tq, heads, dim = q.shape
    scores, _, ct = _dense_scores(q, k, spec)
    lse = torch.logsumexp(scores, dim=-1)                                        # -inf for empty rows
    probs = torch.exp(scores - _finite(lse)[..., None])
    out = torch.einsum("kgqt,tkd->qkgd", probs, v.to(ct)).reshape(tq, heads, dim)
    return out.to(q.dtype), lse.reshape(heads, tq)


def _dense_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
    tq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scores, qg, ct = _dense_scores(q, k, spec)
    lse_g = lse.to(ct).view(kv_heads, group, tq)
    probs = torch.exp(scores - _finite(lse_g)[..., None])                        # masked keys: exp(-inf) = 0
    do = dout.to(ct).view(tq, kv_heads, group, dim)
    delta = (do * out.to(ct).view(tq, kv_heads, group, dim)).sum(-1).permute(1, 2, 0)   # [kv, g, tq]
    if dlse is not None:
        delta = delta - dlse.to(ct).view(kv_heads, group, tq)
    dscores = probs * (torch.einsum("qkgd,tkd->kgqt", do, v.to(ct)) - delta[..., None])
    dq = torch.einsum("kgqt,tkd->qkgd", dscores, k.to(ct)).reshape(tq, heads, dim) * spec.scale
    dk = torch.einsum("kgqt,qkgd->tkd", dscores, qg) * spec.scale
    dv = torch.einsum("kgqt,qkgd->tkd", probs, do)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _window(causal: bool) -> tuple[int, int]:
    return (-1, 0) if causal else (-1, -1)


def _varlen_forward(q, k, v, spec: LseSpec):
    out, lse = varlen_attn(q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k, return_aux=AuxRequest(lse=True),
                           scale=spec.scale, window_size=_window(spec.causal), enable_gqa=k.shape[1] != q.shape[1])
    if lse.shape != (q.shape[1], q.shape[0]):
        lse = lse.transpose(0, 1)
    # FA2 marks rows with no key +inf (so its backward's exp(S - lse) is 0); rows past cu[-1] are unwritten.
    keep = _real_rows(spec.cu_q, q.shape[0])[None, :] & torch.isfinite(lse)
    lse = torch.where(keep, lse.float(), -math.inf)
    out = torch.where(keep.t()[:, :, None], out, out.new_zeros(()))
    return out, lse


def _varlen_kernel_backward(dout, q, k, v, out, lse, spec: LseSpec):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    lse = torch.where(torch.isinf(lse), math.inf, lse).contiguous()              # back to FA2's convention
    return torch.ops.torch_attn._varlen_attn_backward(
        dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k,
        spec.causal, rng_state, spec.scale, list(_window(spec.causal)))


def _varlen_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
    dq, dk, dv = _varlen_kernel_backward(dout, q, k, v, out, lse, spec)
    if dlse is not None:
        # d lse_i = scale * sum_j P_ij (dq_i: k_j ; dk_j: q_i). sum_j P_ij k_j is attention with v := k;
        # sum_i g_i P_ij q_i is the dv a kernel backward returns for dO := g * q.
        g = torch.where(torch.isinf(lse), 0.0, dlse.float()).t()[:, :, None]       # [tq, heads, 1]
        attn_k, _ = _varlen_forward(q, k, k, spec)
        dq = (dq.float() + spec.scale * g * attn_k.float()).to(q.dtype)
        _, _, p_t_q = _varlen_kernel_backward((g * q.float()).to(q.dtype), q, k, k, out, lse, spec)
        dk = (dk.float() + spec.scale * p_t_q.float()).to(k.dtype)
    return dq, dk, dv


# --- merging partials -----------------------------------------------------------------------------
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results.

    ``lse = log(e^lse_a + e^lse_b)`` and ``out = w_a*out_a + w_b*out_b`` with ``w = e^(lse_x - lse)``,
    computed against the row maximum so nothing overflows; rows empty in both stay ``(0, -inf)``.
    Differentiable (the guards keep log(0) and 0/0 out of the backward).
    """
    top = torch.maximum(lse_a, lse_b)
    shift = _finite(top)
    wa, wb = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = wa + wb
    seen = total > 0
    safe = torch.where(seen, total, torch.ones((), dtype=total.dtype, device=total.device))
    lse = torch.where(seen, shift + torch.log(safe), -math.inf)
    ct = torch.promote_types(lse.dtype, out_a.dtype)
    wa, wb = (wa / safe).t()[:, :, None].to(ct), (wb / safe).t()[:, :, None].to(ct)
    return (wa * out_a.to(ct) + wb * out_b.to(ct)).to(out_a.dtype), lse
