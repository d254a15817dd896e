"""Hostile stand-ins for the CUDA attention kernels, for CPU tests of the padding contract.

``hostile_varlen_attn`` / ``hostile_varlen_backward`` have the signatures of torch's feature-detected
``varlen_attn`` (2.12+: ``window_size``, ``scale``, ``enable_gqa``, ``return_aux``) and its backward op,
so ``VarlenAPI.detect`` accepts them; ``hostile_flash_attn_varlen_func`` has flash-attn 2's. On real
rows they compute exact attention (float64, cast to the input dtype; the backward from the statistics it
is given, FlashAttention's recurrence, so merged statistics work as with FA2). Every row they do not own
- queries past ``cu_seq_q[-1]``, keys past ``cu_seq_k[-1]`` - gets ``poison`` (NaN or 1e30) in the
forward output, the lse, and the backward's dq/dk/dv: what uninitialised memory on a GPU may hold.

``install(setter, poison, facts)`` puts them in place of the installed kernels and makes the rule treat
the CPU as a device that runs them (``rule.device_facts``); ``setter`` is ``monkeypatch.setattr`` in a
test, plain ``setattr`` in a spawned rank (whose process ends with the test).

``install(..., selecting=True)`` installs the newer ``varlen_attn`` instead (pytorch PR 193631, on a faked
Hopper with cuDNN 9.19, ``HOPPER``): it selects cuDNN or Flash by what ``sdpa_kernel`` enables, cuDNN
first where its constraints hold (max_q > 128, no GQA, one cu_seqlens tensor for q and k when causal),
*raises* when only cuDNN is enabled and they do not, saves the backend for its own backward, and its
backward op takes that ``backend`` (``SDPBackend`` value). ``Trace.calls`` records which backend ran.

``install(..., auto=True)`` installs torch 2.14's instead: no selection, cuDNN taken by itself wherever it is
eligible (``auto_cudnn``: max_q > 128, no GQA, window ``(-1, -1)``), decided again by its backward op, with
token-major statistics in its cuDNN branch (another layout than Flash's).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flexsp.runtime.kernels import flash as flash_mod
from flexsp.runtime.kernels import rule
from flexsp.runtime.kernels import varlen as varlen_mod
from flexsp.runtime.kernels.rule import DeviceFacts
from flexsp.runtime.kernels.varlen import VarlenAPI

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# An A100-like device (auto runs varlen) whose kernels also take fp32/fp64 CPU tensors.
FACTS = DeviceFacts("cpu", (8, 0), varlen=True, flash=2, kernel_dtypes=FLOATS)
# A Hopper GPU on a torch whose varlen_attn selects its backend, with cuDNN 9.19 (the newer stand-in).
HOPPER = DeviceFacts("cpu", (9, 0), varlen=True, kernel_dtypes=FLOATS, varlen_selects=True, cudnn=91900)
CUDNN, FLASH = 3, 1      # SDPBackend.CUDNN_ATTENTION.value, SDPBackend.FLASH_ATTENTION.value


class Aux(NamedTuple):
    lse: bool = False


class Trace:
    """What the stand-ins saw (per process): the calls and whether cuDNN alone was allowed then."""

    calls: list[dict] = []


def _bounds(cu) -> list[int]:
    return [int(b) for b in cu.tolist()]


def _scores(q, k, qa, qb, ka, kb, causal, scale, left=-1, softcap=None):
    """Scores of one sequence, bottom-right causal, flash-attn's ``window_size=(left, 0)`` and ``softcap``;
    with ``d capped / d raw`` (1 without a softcap)."""
    s = torch.einsum("qhd,khd->hqk", q[qa:qb], k[ka:kb]) * scale
    dcap = 1.0
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = t * softcap, 1 - t * t
    if causal:
        lq, lk = qb - qa, kb - ka
        ahead = (lq - torch.arange(lq))[:, None] - (lk - torch.arange(lk))[None, :]   # query pos - key pos, <= 0 seen
        seen = ahead <= 0
        if left >= 0:
            seen = seen & (-ahead <= left)
        s = s.masked_fill(~seen, -math.inf)
    return s, dcap


def _repeat(q, k, v):
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), group


def _forward(q, k, v, cu_q, cu_k, causal, scale, poison, left=-1, softcap=None):
    """Exact ``(out, lse [heads, tq] float32)`` on real rows (FA2: a row without keys is ``(0, +inf)``); poison after."""
    q64 = q.double()
    k64, v64, _ = _repeat(q64, k.double(), v.double())
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    out = torch.full(q.shape, poison, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), poison, dtype=torch.float64)
    for (qa, qb), (ka, kb) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        s, _ = _scores(q64, k64, qa, qb, ka, kb, causal, scale, left, softcap)
        row = torch.logsumexp(s, -1) if kb > ka else torch.full((q.shape[1], qb - qa), -math.inf, dtype=torch.float64)
        p = torch.exp(s - torch.where(torch.isinf(row), 0.0, row)[..., None])
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p, v64[ka:kb])
        lse[:, qa:qb] = torch.where(torch.isinf(row), math.inf, row)
    return out.to(q.dtype), lse.float()


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, poison, left=-1, softcap=None):
    """``(dq, dk, dv)`` from the given statistics (``P = exp(S - lse)``, ``D = rowsum(dO * O)``); poison after."""
    q64, do, o = q.double(), dout.double(), out.double()
    k64, v64, group = _repeat(q64, k.double(), v.double())
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    dq = torch.full(q.shape, poison, dtype=torch.float64)
    dk = torch.zeros(k64.shape, dtype=torch.float64)
    dv = torch.zeros(v64.shape, dtype=torch.float64)
    stat = lse.double()
    for (qa, qb), (ka, kb) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
        s, dcap = _scores(q64, k64, qa, qb, ka, kb, causal, scale, left, softcap)
        p = torch.exp(s - stat[:, qa:qb, None])                                   # lse +inf: 0
        delta = (do[qa:qb] * o[qa:qb]).sum(-1).t()                                 # [h, lq]
        ds = p * (torch.einsum("qhd,khd->hqk", do[qa:qb], v64[ka:kb]) - delta[..., None]) * dcap
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", ds, k64[ka:kb]) * scale
        dk[ka:kb] = torch.einsum("hqk,qhd->khd", ds, q64[qa:qb]) * scale
        dv[ka:kb] = torch.einsum("hqk,qhd->khd", p, do[qa:qb])
    if group > 1:
        dk, dv = (t.unflatten(1, (k.shape[1], group)).sum(2) for t in (dk, dv))
    dk[bk[-1]:] = poison
    dv[bk[-1]:] = poison
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cudnn_only() -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()


class _Attention(torch.autograd.Function):
    """The stand-in's autograd: its own backward writes poison into rows it does not own, as FA2's may."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, poison, left=-1, softcap=None, backend=None):
        """``backend``: the newer stand-in's selection, which its backward records (None: the older ones')."""
        with torch.profiler.record_function(f"aten::_{backend or 'flash'}_attention_forward"):
            out, lse = _forward(q, k, v, cu_q, cu_k, causal, scale, poison, left, softcap)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = causal, scale, poison, left, softcap, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        causal, scale, poison, left, softcap, backend = ctx.args
        if backend is not None:
            Trace.calls.append({"op": "autograd backward", "cudnn": _cudnn_only(), "kv_heads": k.shape[1],
                                "backend": backend})
        with torch.profiler.record_function(f"aten::_{backend or 'flash'}_attention_backward"):
            grads = _backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, poison, left, softcap)
        return (*grads, None, None, None, None, None, None, None, None)


POISON = {"value": float("nan")}   # per process; ``install`` sets it


def hostile_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12+'s ``varlen_attn`` signature; lse ``[heads, tokens]`` float32."""
    left, right = tuple(window_size)
    assert right in (0, -1) and left >= -1 and (right == 0 or left == -1)
    assert enable_gqa or key.shape[1] == query.shape[1]
    Trace.calls.append({"op": "forward", "cudnn": _cudnn_only(), "kv_heads": key.shape[1], "window": left,
                        "backend": "flash"})
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, lse = _Attention.apply(query, key, value, cu_seq_q, cu_seq_k, right == 0, scale, POISON["value"], left)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def hostile_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                            rng_state, scale=None, window_size=None):
    """The backward op's schema (``torch_attn::_varlen_attn_backward``)."""
    left = -1 if window_size is None else int(window_size[0])
    Trace.calls.append({"op": "backward", "cudnn": _cudnn_only(), "kv_heads": key.shape[1], "window": left,
                        "backend": "flash"})
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    with torch.profiler.record_function("aten::_flash_attention_backward"):
        return _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, is_causal, scale,
                         POISON["value"], left)


# --- the newer varlen_attn: selection by sdpa_kernel, cuDNN's constraints, the backend saved for backward ----
def select_backend(query, key, value, cu_seq_q, cu_seq_k, max_q, window_size, enable_gqa=False, seqused_k=None,
                   block_table=None, num_splits=None) -> int:
    """torch's ``_select_backend`` rules: cuDNN first when enabled and eligible, else Flash when enabled, else
    an error naming cuDNN's unmet constraints."""
    cudnn_on = torch.backends.cuda.cudnn_sdp_enabled()
    reasons = []
    if max_q <= 128:
        reasons.append("max_q must be greater than 128")
    if query.shape[-1] % 8 or query.shape[-1] > 128:
        reasons.append("head dimension")
    if list(window_size) == [-1, 0] and cu_seq_q is not cu_seq_k:
        reasons.append("causal attention requires the same cu_seq tensor for Q and K")
    if enable_gqa or query.shape[1] != key.shape[1]:
        reasons.append("GQA is not supported")
    if cudnn_on and not reasons:
        return CUDNN
    if torch.backends.cuda.flash_sdp_enabled():
        return FLASH
    if cudnn_on:
        raise RuntimeError("SDPBackend.CUDNN_ATTENTION was requested for varlen_attn, but its constraints are not "
                           "satisfied: " + "; ".join(reasons))
    raise RuntimeError("No viable backend for varlen_attn")


def selecting_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The newer ``varlen_attn``: the backend selected here, saved for the autograd backward."""
    assert tuple(window_size) in ((-1, 0), (-1, -1))
    assert enable_gqa or key.shape[1] == query.shape[1]
    backend = "cudnn" if select_backend(query, key, value, cu_seq_q, cu_seq_k, max_q, list(window_size),
                                        enable_gqa) == CUDNN else "flash"
    Trace.calls.append({"op": "forward", "cudnn": _cudnn_only(), "kv_heads": key.shape[1], "backend": backend})
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, lse = _Attention.apply(query, key, value, cu_seq_q, cu_seq_k, tuple(window_size) == (-1, 0), scale,
                                POISON["value"], -1, None, backend)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def selecting_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                              rng_state, scale=None, window_size=None, backend=FLASH):
    """The newer backward op: runs the ``backend`` it is given (the forward's), whatever is enabled now."""
    name = {CUDNN: "cudnn", FLASH: "flash"}[backend]
    Trace.calls.append({"op": "backward", "cudnn": _cudnn_only(), "kv_heads": key.shape[1], "backend": name})
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    with torch.profiler.record_function(f"aten::_{name}_attention_backward"):
        return _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, is_causal, scale,
                         POISON["value"])


# --- torch 2.14's varlen_attn: cuDNN taken by itself where eligible, no selection, other statistics layout ---
def auto_cudnn(query, key, max_q, window_size, enable_gqa=False) -> bool:
    """torch 2.14's ``_can_use_cudnn`` (device, cuDNN version and dtype taken as met): max_q > 128, no GQA and
    window ``(-1, -1)`` - never a causal call (``(-1, 0)``)."""
    return max_q > 128 and list(window_size) == [-1, -1] and not enable_gqa and query.shape[1] == key.shape[1]


def _no_window(window_size, max_q, max_k) -> list[int]:
    """A window reaching keys after the query is taken only where it covers every key: the same as none."""
    left, right = (-1, -1) if window_size is None else tuple(window_size)
    if right > 0:
        assert left >= max_k - 1 and right >= max_q - 1, f"window {window_size} does not cover every key"
        return [-1, -1]
    return [left, right]


def auto_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.14's ``varlen_attn``: cuDNN wherever ``auto_cudnn`` holds, its lse token-major ``[tokens, heads, 1]``
    (not Flash's ``[heads, tokens]``: what cuDNN's statistics may be)."""
    cudnn = auto_cudnn(query, key, max_q, window_size, enable_gqa)
    result = hostile_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                                 scale=scale, window_size=_no_window(window_size, max_q, max_k), enable_gqa=enable_gqa)
    Trace.calls[-1]["backend"] = "cudnn" if cudnn else "flash"
    if cudnn and return_aux is not None and return_aux.lse:
        out, lse = result
        return out, lse.t().contiguous().unsqueeze(-1)
    return result


def auto_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                         rng_state, scale=None, window_size=None):
    """torch 2.14's backward op: decides cuDNN again by the same rule (it is not told the forward's), and its
    cuDNN branch reads ``lse`` as token-major statistics."""
    window = [-1, -1] if window_size is None else list(window_size)
    cudnn = auto_cudnn(query, key, max_q, window)
    if cudnn:
        lse = lse.reshape(query.shape[0], query.shape[1]).t()
    grads = hostile_varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k,
                                    is_causal, rng_state, scale, _no_window(window, max_q, max_k))
    Trace.calls[-1]["backend"] = "cudnn" if cudnn else "flash"
    return grads


def hostile_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's ``flash_attn_varlen_func`` (GQA native)."""
    assert dropout_p == 0.0 and tuple(window_size)[1] in (0, -1)
    Trace.calls.append({"op": "flash", "cudnn": _cudnn_only(), "kv_heads": k.shape[1], "window": window_size[0],
                        "softcap": softcap})
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, POISON["value"],
                                int(window_size[0]), softcap or None)
    return (out, lse, None) if return_attn_probs else out


def hostile_flash_attn_varlen_sink_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        softmax_scale=None, causal=False, window_size=(None, None),
                                        learnable_sink=None, softcap=0.0):
    """A FlashAttention-4 style varlen call (``learnable_sink``, a ``(out, lse)`` tuple): computed in float64
    with the sink as an extra zero-value key (autograd through it), poison in the rows it does not own."""
    Trace.calls.append({"op": "flash_sink", "kv_heads": k.shape[1], "window": window_size[0], "softcap": softcap,
                        "sink": learnable_sink is not None})
    from flexsp.runtime.kernels import reference
    left = -1 if window_size[0] is None else int(window_size[0])
    k64, v64, _ = _repeat(q, k.double(), v.double())
    bounds = _bounds(cu_seqlens_q)
    out, lse = reference(q.double(), k64, v64, bounds, causal=causal, scale=softmax_scale, return_lse=True,
                         window=None if left < 0 else left + 1, softcap=softcap or None,
                         sinks=None if learnable_sink is None else learnable_sink.double())
    owned = (torch.arange(q.shape[0]) < bounds[-1])[:, None, None]
    out = torch.where(owned, out, POISON["value"])
    return out.to(q.dtype), lse.float()


def install(setter=setattr, poison: float = float("nan"), facts: DeviceFacts | None = None, flash=None, *,
            selecting: bool = False, auto: bool = False) -> VarlenAPI:
    """The stand-ins in place of ``varlen_attn`` and flash-attn, the rule told the CPU runs them (``facts``:
    ``HOPPER`` with ``selecting``, else ``FACTS``). ``flash``: the flash-attn function to stand in (default:
    flash-attn 2's), its features read from its signature as ``flash.installed`` reads the real one's."""
    facts = facts if facts is not None else HOPPER if selecting else FACTS
    if selecting:
        api = VarlenAPI.detect(selecting_varlen_attn, Aux, selecting_varlen_backward, select_backend)
        assert api is not None and api.selects
    elif auto:
        api = VarlenAPI.detect(auto_varlen_attn, Aux, auto_varlen_backward, auto_cudnn=True)
        assert api is not None and not api.selects and api.auto_cudnn
    else:
        api = VarlenAPI.detect(hostile_varlen_attn, Aux, hostile_varlen_backward)
        assert api is not None and not api.selects
    assert api.backward_op is not None and api.gqa and api.scale
    setter(varlen_mod, "VARLEN", api)
    setter(flash_mod, "FLASH", flash_mod.FlashAPI.of(flash or hostile_flash_attn_varlen_func, 2))
    setter(rule, "device_facts", lambda device=None: facts)
    POISON["value"] = poison
    Trace.calls.clear()
    return api
