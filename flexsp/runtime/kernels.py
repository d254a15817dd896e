"""Local attention over packed sequences, and the log-sum-exp form the ring axis merges.

Two entry points share one set of kernels:

* ``attend(q, k, v, cu_seqlens, *, max_seqlen, bounds)`` - causal within each packed sequence, never across.
* ``attend_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal)`` -
  queries and keys with their own bounds (sequence ``i`` of q attends to sequence ``i`` of k), returning
  ``(out, lse)`` so partial results over disjoint key sets combine exactly with ``merge_partials``.
  Differentiable through both outputs.

Kernels (``backend=``), and which one ``auto`` runs where:

==============================  ====================================================================
device / dtype                  ``auto`` runs
==============================  ====================================================================
CUDA, fp16/bf16                 ``varlen``: torch's ``varlen_attn`` (FA2; signature feature-detected,
                                ``flexsp.runtime.varlen_api``); else ``flash`` (flash-attn varlen) if
                                installed; else ``sdpa``
CUDA, fp32/fp64                 ``sdpa`` (SDPA picks its efficient/cuDNN kernel per call)
CPU, any dtype                  ``sdpa`` (SDPA's fused CPU flash kernel; the lse form calls that
                                kernel's op directly)
==============================  ====================================================================

``sdpa`` is exact and its work and memory scale with ``sum(s^2)``, never with the packed stream's
``T^2``: one ``is_causal`` SDPA call per sequence on 4-D ``[n, heads, s, dim]`` views (no copy), with
runs of adjacent equal-length sequences batched into one call - the 4-D layout is what lets SDPA
dispatch its fused kernels (3-D inputs or a mask fall back to the math kernel). ``sdpa_each`` is the
same without batching (one call per sequence; ``flexsp profile``/``replay`` measure with it).
``reference`` is an explicit softmax per sequence (tests only). No kernel builds a ``T x T`` mask.

Layouts: ``q [tokens, heads, dim]``, ``k``/``v`` ``[tokens_k, kv_heads, dim]`` with heads % kv_heads == 0
(query head ``h`` uses kv head ``h // (heads // kv_heads)``). ``cu_seqlens`` is ``[n+1]`` int bounds: a
tuple, or an int32 tensor. ``varlen``/``flash`` never read a device tensor on the host (``max_seqlen``
must be given), so a CUDA step never waits on the GPU. The per-sequence ``sdpa`` kernels need the bounds
as host ints: ``bounds=`` (``AttentionContext`` carries them), a tuple, or a CPU tensor (free to read);
a device tensor without ``bounds`` is refused rather than silently synchronising every layer.
Tokens past ``cu_seqlens[-1]`` are padding: their output is zero, their lse ``-inf``, and they get no
gradient. ``lse`` is ``[heads, tokens_q]``, float32 (float64 for float64 inputs); a row that attends
to no key has ``out = 0`` and ``lse = -inf``. With ``causal`` and unequal q/k lengths the mask is
bottom-right aligned (flash-attn's convention): query ``i`` of ``Lq`` sees key ``j`` of ``Lk`` iff
``Lk - j >= Lq - i``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from flexsp.errors import FlexSPError
from flexsp.runtime.varlen_api import VarlenAPI, installed

try:  # optional: only on GPU machines with flash-attn built
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match the installed torch
    flash_attn_varlen_func = None

VARLEN: VarlenAPI | None = installed()   # read once at import; None on a torch without a known varlen_attn
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)



def _count_cpu_flash_flops() -> None:
    """Teach ``FlopCounterMode`` the CPU flash op (torch counts only the CUDA SDPA kernels), so FLOP-based
    measurements (``flexsp replay``'s cost-form checks) see attention whichever fused kernel ran."""
    from torch.utils import flop_counter

    if _CPU_FLASH is None or _CPU_FLASH in flop_counter.flop_registry:
        return

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    flop_counter.register_flop_formula(_CPU_FLASH)(forward)
    if _CPU_FLASH_BACKWARD is not None:
        flop_counter.register_flop_formula(_CPU_FLASH_BACKWARD)(backward)


try:
    _count_cpu_flash_flops()
except Exception:   # an older torch without these helpers: counts are only used for measurement
    pass

BACKENDS = ("auto", "varlen", "flash", "sdpa", "sdpa_each", "reference")
Bounds = Sequence[int] | torch.Tensor


class AttentionError(FlexSPError):
    """Attention inputs do not fit together (shapes, bounds, backend)."""


# --- backend choice -------------------------------------------------------------------------------
def _is_cuda(device: torch.device | str | None) -> bool:
    """A CUDA device (a CUDA tensor exists, or fake CUDA tensors under FakeTensorMode), or CUDA present."""
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def flash_available(device: torch.device | str | None = None) -> bool:
    """flash-attn is importable and the tensors are (or would be) on CUDA."""
    return flash_attn_varlen_func is not None and _is_cuda(device)


def varlen_available(device: torch.device | str | None = None) -> bool:
    """torch's own varlen FlashAttention can run: a known ``varlen_attn`` signature and CUDA tensors."""
    return VARLEN is not None and _is_cuda(device)


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The kernel ``backend`` runs for ``q`` (see the module's table for ``auto``)."""
    if backend not in BACKENDS:
        raise AttentionError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    half = q.dtype in (torch.float16, torch.bfloat16)
    if backend == "auto":
        if half and varlen_available(q.device):
            return "varlen"
        if half and flash_available(q.device):
            return "flash"
        return "sdpa"
    if backend == "flash" and not (flash_available(q.device) and half):
        raise AttentionError("attention backend 'flash' needs flash_attn installed and CUDA tensors in "
                             "float16/bfloat16; use backend='sdpa' or 'auto'")
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


def _host_bounds(cu: Bounds, given: Sequence[int] | None, tokens: int, name: str) -> list[int]:
    """The bounds as host ints for the per-sequence kernels: ``given``, a tuple, or a CPU tensor (free to
    read). A device tensor without ``given`` is refused: reading it would make every layer wait on the GPU."""
    if given is not None:
        bounds = [int(b) for b in given]
    elif isinstance(cu, torch.Tensor):
        if cu.device.type != "cpu":
            raise AttentionError(f"the per-sequence kernel needs {name} as host ints (bounds=, which "
                                 f"AttentionContext carries); reading device {name} would sync the host every layer")
        bounds = [int(b) for b in cu.tolist()]
    else:
        bounds = [int(b) for b in cu]
    _check_bounds(bounds, tokens, name)
    return bounds


def _runs(bounds: Sequence[int], batch: bool) -> list[tuple[int, int, int]]:
    """``(start, length, count)``: non-empty sequences, adjacent equal lengths merged into one run when ``batch``."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        if batch and runs and runs[-1][1] == b - a and runs[-1][0] + runs[-1][1] * runs[-1][2] == a:
            start, length, count = runs[-1]
            runs[-1] = (start, length, count + 1)
        else:
            runs.append((a, b - a, 1))
    return runs


def _heads_first(x: torch.Tensor, start: int, length: int, count: int) -> torch.Tensor:
    """Rows ``start .. start + length*count`` of ``x [tokens, heads, dim]`` as a ``[count, heads, length, dim]`` view."""
    return x[start:start + length * count].unflatten(0, (count, length)).transpose(1, 2)


# --- attend: causal, one packed stream ----------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Bounds, *,
           max_seqlen: int | None = None, backend: str = "auto", scale: float | None = None,
           bounds: Sequence[int] | None = None) -> torch.Tensor:
    """Causal attention per packed sequence; returns ``[tokens, heads, dim]`` like ``q``.

    ``bounds``: ``cu_seqlens`` as host ints, for the per-sequence kernels when ``cu_seqlens`` is on a device."""
    _check_shapes(q, k, v, same_tokens=True)
    kernel = resolve_backend(backend, q)
    tokens, heads, dim = q.shape
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if kernel == "reference":
        return reference(q, k, v, cu_seqlens if bounds is None else bounds, scale=scale)
    if kernel in ("sdpa", "sdpa_each"):
        return _sdpa_packed(q, k, v, _host_bounds(cu_seqlens, bounds, tokens, "cu_seqlens"), scale,
                            batch=kernel == "sdpa")
    cu = _bounds_tensor(cu_seqlens, tokens, q.device, "cu_seqlens")
    real = _real_rows(cu, tokens).view(-1, 1, 1)
    max_seqlen = _max_len(cu_seqlens, max_seqlen, "max_seqlen")
    if kernel == "varlen":
        out = VARLEN.forward(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, scale=scale)
    else:  # flash-attn reads kv head h // (heads / kv_heads) itself, like varlen_attn's enable_gqa
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    return torch.where(real, out, out.new_zeros(()))   # padding rows: zero output, no gradient


def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int], scale: float, *,
                 batch: bool) -> torch.Tensor:
    """``is_causal`` SDPA per sequence (or per run of equal lengths) on 4-D views, outputs concatenated:
    the work of a varlen kernel (sum of s^2) through SDPA's fused kernels, one Python call per run."""
    tokens, heads, dim = q.shape
    gqa = k.shape[1] != heads
    parts = []
    for start, length, count in _runs(bounds, batch):
        out = F.scaled_dot_product_attention(_heads_first(q, start, length, count), _heads_first(k, start, length, count),
                                             _heads_first(v, start, length, count), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        parts.append(out.transpose(1, 2).reshape(length * count, heads, dim))
    pad = tokens - bounds[-1]
    if pad:
        parts.append(q.new_zeros(pad, heads, dim))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


# --- masks built on the device ------------------------------------------------------------------
def _segments(cu: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its sequence index (``n`` for padding past ``cu[-1]``) and its distance to that end."""
    n = cu.numel() - 1
    pos = torch.arange(tokens, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu, pos, right=True) - 1            # last bound <= pos: skips empty sequences
    end = cu[(seq + 1).clamp(max=n)]
    return seq, end - pos


def block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, tokens_q: int, tokens_k: int, causal: bool) -> torch.Tensor:
    """``[tokens_q, tokens_k]`` bool: query i may attend key j (same sequence, causal bottom-right).

    A reference for tests and layout checks: no kernel here builds it."""
    if cu_q.numel() != cu_k.numel():
        raise AttentionError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}")
    seq_q, to_end_q = _segments(cu_q, tokens_q)
    seq_k, to_end_k = _segments(cu_k, tokens_k)
    allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q < cu_q.numel() - 1)[:, None]
    if causal:
        allowed &= to_end_k[None, :] >= to_end_q[:, None]
    return allowed


def _real_rows(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    # function-form ops, not ``[]``: Python indexing takes a device guard, which fake CUDA tensors cannot
    return torch.arange(tokens, device=cu.device, dtype=cu.dtype) < cu.select(0, cu.numel() - 1)


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
               backend: str = "auto", scale: float | None = None, bounds_q: Sequence[int] | None = None,
               bounds_k: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    max_q = _max_len(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    max_k = _max_len(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
    if kernel in ("varlen", "flash"):
        spec = LseSpec(cu_q, cu_k, max_q, max_k, bool(causal), scale, "varlen")
    else:
        host_q = tuple(_host_bounds(cu_seqlens_q, bounds_q, q.shape[0], "cu_seqlens_q"))
        host_k = tuple(_host_bounds(cu_seqlens_k, bounds_k, k.shape[0], "cu_seqlens_k"))
        spec = LseSpec(cu_q, cu_k, max_q, max_k, bool(causal), scale, "sdpa", host_q, host_k)
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
    kernel: str                 # "varlen" (device bounds only) or "sdpa" (per sequence, host bounds)
    bounds_q: tuple[int, ...] | None = None   # host copies for "sdpa"; None: read cu_q (a CPU tensor)
    bounds_k: tuple[int, ...] | None = None

    def host(self) -> tuple[list[int], list[int]]:
        """Host bounds of q and k for the per-sequence kernel (refuses to read a device tensor)."""
        return (_host_bounds(self.cu_q, self.bounds_q, 1 << 62, "cu_seqlens_q"),
                _host_bounds(self.cu_k, self.bounds_k, 1 << 62, "cu_seqlens_k"))


def lse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """No-autograd partial attention: ``(out, lse)`` with the conventions of ``attend_lse``."""
    if spec.kernel == "varlen":
        return _varlen_forward(q, k, v, spec)
    return _each_forward(q, k, v, spec)


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
    return _each_backward(dout, q, k, v, out, lse, spec, dlse)


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


# --- per-sequence lse kernels (any device; CPU's fused flash op where it applies) ------------------
def _pairs(spec: LseSpec):
    """``(qa, qb, ka, kb)`` of every sequence with queries (rows of sequences without keys stay empty)."""
    bq, bk = spec.host()
    return [(qa, qb, ka, kb) for qa, qb, ka, kb in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]) if qb > qa]


def _fused(q: torch.Tensor, spec: LseSpec, lq: int, lk: int) -> bool:
    """CPU's flash op applies: CPU tensors, and a causal mask that is the same top-left or bottom-right."""
    return _CPU_FLASH is not None and q.device.type == "cpu" and (not spec.causal or lq == lk)


def _four_d(x: torch.Tensor, a: int, b: int, heads: int) -> torch.Tensor:
    """Rows ``a:b`` as ``[1, heads, rows, dim]`` (kv heads repeated to ``heads``: the op has no GQA)."""
    part = x[a:b]
    if part.shape[1] != heads:
        part = part.repeat_interleave(heads // part.shape[1], dim=1)
    return part.transpose(0, 1).unsqueeze(0)


def _explicit_scores(q, k, spec: LseSpec, lq: int, lk: int, ct):
    """``[heads, lq, lk]`` scores of one sequence in ``ct``, bottom-right causal masked."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.to(ct), k.repeat_interleave(group, dim=1).to(ct)) * spec.scale
    if spec.causal:
        seen = (lk - torch.arange(lk, device=q.device))[None, :] >= (lq - torch.arange(lq, device=q.device))[:, None]
        scores = scores.masked_fill(~seen, -math.inf)
    return scores


def _each_forward(q, k, v, spec: LseSpec):
    tq, heads, dim = q.shape
    ct = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape)
    lse = torch.full((heads, tq), -math.inf, dtype=ct, device=q.device)
    for qa, qb, ka, kb in _pairs(spec):
        lq, lk = qb - qa, kb - ka
        if lk == 0:
            continue
        if _fused(q, spec, lq, lk):
            o, l = _CPU_FLASH(_four_d(q, qa, qb, heads), _four_d(k, ka, kb, heads), _four_d(v, ka, kb, heads), 0.0,
                              spec.causal, scale=spec.scale)
            out[qa:qb] = o[0].transpose(0, 1)
            lse[:, qa:qb] = l[0].to(ct)
            continue
        scores = _explicit_scores(q[qa:qb], k[ka:kb], spec, lq, lk, ct)
        row = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(row)[..., None])
        group = heads // k.shape[1]
        out[qa:qb] = torch.einsum("hqk,khd->qhd", probs, v[ka:kb].repeat_interleave(group, dim=1).to(ct)).to(q.dtype)
        lse[:, qa:qb] = row
    return out, lse


def _each_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
    tq, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    ct = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = torch.zeros(q.shape, dtype=ct, device=q.device), torch.zeros(k.shape, dtype=ct, device=q.device), \
        torch.zeros(v.shape, dtype=ct, device=q.device)
    for qa, qb, ka, kb in _pairs(spec):
        lq, lk = qb - qa, kb - ka
        if lk == 0:
            continue
        if dlse is None and _fused(q, spec, lq, lk):
            # the op reads P = exp(S - lse) and D = rowsum(dO * O) from the statistics it is given: merged ones work
            gq, gk, gv = _CPU_FLASH_BACKWARD(
                _four_d(dout, qa, qb, heads), _four_d(q, qa, qb, heads), _four_d(k, ka, kb, heads),
                _four_d(v, ka, kb, heads), _four_d(out, qa, qb, heads),
                lse[:, qa:qb].to(torch.promote_types(q.dtype, torch.float32)).unsqueeze(0).contiguous(),
                0.0, spec.causal, scale=spec.scale)
            dq[qa:qb] = gq[0].transpose(0, 1).to(ct)
            dk[ka:kb] += gk[0].transpose(0, 1).unflatten(1, (kv_heads, group)).sum(2).to(ct)
            dv[ka:kb] += gv[0].transpose(0, 1).unflatten(1, (kv_heads, group)).sum(2).to(ct)
            continue
        scores = _explicit_scores(q[qa:qb], k[ka:kb], spec, lq, lk, ct)
        probs = torch.exp(scores - _finite(lse[:, qa:qb].to(ct))[..., None])          # masked keys: 0
        do = dout[qa:qb].to(ct)
        kr = k[ka:kb].repeat_interleave(group, dim=1).to(ct)
        vr = v[ka:kb].repeat_interleave(group, dim=1).to(ct)
        delta = (do * out[qa:qb].to(ct)).sum(-1).t()                                    # [heads, lq]
        if dlse is not None:
            delta = delta - dlse[:, qa:qb].to(ct)
        dscores = probs * (torch.einsum("qhd,khd->hqk", do, vr) - delta[..., None])
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", dscores, kr) * spec.scale
        dk[ka:kb] += (torch.einsum("hqk,qhd->khd", dscores, q[qa:qb].to(ct)) * spec.scale).unflatten(
            1, (kv_heads, group)).sum(2)
        dv[ka:kb] += torch.einsum("hqk,qhd->khd", probs, do).unflatten(1, (kv_heads, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- varlen lse kernels (CUDA) --------------------------------------------------------------------
def _varlen_forward(q, k, v, spec: LseSpec):
    out, lse = VARLEN.forward(q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k, causal=spec.causal,
                              scale=spec.scale, lse=True)
    # FA2 marks rows with no key +inf (so its backward's exp(S - lse) is 0); rows past cu[-1] are unwritten.
    keep = _real_rows(spec.cu_q, q.shape[0]).unsqueeze(0) & torch.isfinite(lse)
    lse = torch.where(keep, lse, -math.inf)
    out = out.masked_fill(keep.t().unsqueeze(-1).logical_not(), 0.0)   # keeps out's (contiguous) layout
    return out, lse


def _varlen_kernel_backward(dout, q, k, v, out, lse, spec: LseSpec):
    lse = torch.where(torch.isinf(lse), math.inf, lse).contiguous()              # back to FA2's convention
    return VARLEN.backward(dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse, spec.cu_q, spec.cu_k,
                           spec.max_q, spec.max_k, causal=spec.causal, scale=spec.scale)


def _varlen_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
    dq, dk, dv = _varlen_kernel_backward(dout, q, k, v, out, lse, spec)
    if dlse is not None:
        # d lse_i = scale * sum_j P_ij (dq_i: k_j ; dk_j: q_i). sum_j P_ij k_j is attention with v := k;
        # sum_i g_i P_ij q_i is the dv a kernel backward returns for dO := g * q.
        g = torch.where(torch.isinf(lse), 0.0, dlse.float()).t().unsqueeze(-1)     # [tq, heads, 1]
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
    wa, wb = (wa / safe).t().unsqueeze(-1).to(ct), (wb / safe).t().unsqueeze(-1).to(ct)
    return (out_a.to(ct) * wa + out_b.to(ct) * wb).to(out_a.dtype), lse   # out first: its layout is kept
