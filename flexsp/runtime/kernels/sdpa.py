"""Per-sequence kernels: ``is_causal`` SDPA per sequence for ``attend``, and the log-sum-exp forms.

``attend``'s ``sdpa`` is exact and its work and memory scale with ``sum(s^2)``, never with the packed
stream's ``T^2``: one ``is_causal`` SDPA call per sequence on 4-D ``[n, heads, s, dim]`` views (no copy),
with runs of adjacent equal-length sequences batched into one call - the 4-D layout is what lets SDPA
dispatch its fused kernels (cuDNN or flash on CUDA, the fused flash kernel on CPU; 3-D inputs or a mask
fall back to the math kernel). ``sdpa_each`` is the same without batching.

The lse forms (``each_forward``/``each_backward``, the ring's kernels where ``varlen`` cannot run) call
CPU's fused flash op directly where it applies, else an explicit softmax per sequence, in query-row tiles
of bounded memory (``row_tiles``: a ring block of a long context never builds its ``lq x lk`` scores).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from flexsp.runtime.kernels.features import PLAIN
from flexsp.runtime.kernels.layout import LseSpec
from flexsp.runtime.kernels.reference import causal_seen

# The explicit lse form works on query-row tiles whose fp32 scores take at most this many bytes, with
# ``_TEMPORARIES`` tensors of that size alive at once (scores, probabilities, their gradient, the mask).
TILE_BYTES = 256 * 2**20
_TEMPORARIES = 4
MIN_BAND_ROWS = 128   # banded tiles have at least this many rows (fewer Python steps for tiny windows)

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


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows without keys) replaced by 0, safe to subtract."""
    return torch.where(torch.isinf(lse), torch.zeros((), dtype=lse.dtype, device=lse.device), lse)


# --- attend ---------------------------------------------------------------------------------------
def runs(bounds: Sequence[int], batch: bool) -> list[tuple[int, int, int]]:
    """``(start, length, count)``: non-empty sequences, adjacent equal lengths merged into one run when ``batch``."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        if batch and out and out[-1][1] == b - a and out[-1][0] + out[-1][1] * out[-1][2] == a:
            start, length, count = out[-1]
            out[-1] = (start, length, count + 1)
        else:
            out.append((a, b - a, 1))
    return out


def _heads_first(x: torch.Tensor, start: int, length: int, count: int) -> torch.Tensor:
    """Rows ``start .. start + length*count`` of ``x [tokens, heads, dim]`` as a ``[count, heads, length, dim]`` view."""
    return x[start:start + length * count].unflatten(0, (count, length)).transpose(1, 2)


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int], scale: float, *,
           batch: bool) -> torch.Tensor:
    """``is_causal`` SDPA per sequence (or per run of equal lengths) on 4-D views, outputs concatenated:
    the work of a varlen kernel (sum of s^2) through SDPA's fused kernels, one Python call per run."""
    tokens, heads, dim = q.shape
    gqa = k.shape[1] != heads
    parts = []
    for start, length, count in runs(bounds, batch):
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


# --- lse forms ------------------------------------------------------------------------------------
def _pairs(spec: LseSpec):
    """``(qa, qb, ka, kb)`` of every sequence with queries (rows of sequences without keys stay empty)."""
    bq, bk = spec.host()
    return [(qa, qb, ka, kb) for qa, qb, ka, kb in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]) if qb > qa]


def _fused(q: torch.Tensor, spec: LseSpec, lq: int, lk: int) -> bool:
    """CPU's flash op applies: CPU tensors, plain causal attention (no window, chunk, softcap or explicit
    positions), and a causal mask that is the same top-left or bottom-right."""
    return (_CPU_FLASH is not None and q.device.type == "cpu" and (spec.features is None or spec.features.plain)
            and spec.pos_q is None and (not spec.causal or lq == lk))


def _four_d(x: torch.Tensor, a: int, b: int, heads: int) -> torch.Tensor:
    """Rows ``a:b`` as ``[1, heads, rows, dim]`` (kv heads repeated to ``heads``: the op has no GQA)."""
    part = x[a:b]
    if part.shape[1] != heads:
        part = part.repeat_interleave(heads // part.shape[1], dim=1)
    return part.transpose(0, 1).unsqueeze(0)


def _seen(spec: LseSpec, seq: tuple[int, int, int, int], rows: tuple[int, int], keys: tuple[int, int],
          device: torch.device) -> torch.Tensor | None:
    """``[rows, keys]`` bool mask of query rows ``rows`` against key rows ``keys`` (absolute) of one sequence
    ``seq``, or None (every key seen). Positions are the spec's (the ring's zigzag blocks) or bottom-right
    aligned ones; a window or chunk needs them even where ``causal`` is off."""
    feats = spec.features
    positional = feats is not None and feats.positional
    if not (spec.causal or positional):
        return None
    qa, qb, ka, kb = seq
    ra, rb = rows
    k0, k1 = keys
    lq, lk = qb - qa, kb - ka
    if spec.pos_q is None and not positional and (ra, rb, k0, k1) == (qa, qb, ka, kb):
        return causal_seen(lq, lk, device)
    pos_q = (spec.pos_q[ra:rb] if spec.pos_q is not None
             else torch.arange(lk - lq + ra - qa, lk - lq + rb - qa, device=device))
    pos_k = spec.pos_k[k0:k1] if spec.pos_k is not None else torch.arange(k0 - ka, k1 - ka, device=device)
    return (feats if feats is not None else PLAIN).seen(pos_q, pos_k)


def host_positions(spec: LseSpec, seq: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Query and key positions of one sequence as ascending host int arrays, for ``key_band``: aranges when
    bottom-right aligned, the spec's host copies otherwise; None (no banding, the mask alone decides) for a
    layer without window or chunk, positions only on the device, or positions not ascending."""
    feats = spec.features
    if feats is None or not feats.positional:
        return None
    qa, qb, ka, kb = seq
    if spec.pos_q is None:
        return np.arange(kb - ka - (qb - qa), kb - ka), np.arange(kb - ka)
    if spec.host_pos_q is None or spec.host_pos_k is None:
        return None
    pos_q, pos_k = np.asarray(spec.host_pos_q[qa:qb]), np.asarray(spec.host_pos_k[ka:kb])
    if (np.diff(pos_q) < 0).any() or (np.diff(pos_k) < 0).any():
        return None
    return pos_q, pos_k


def key_band(spec: LseSpec, seq: tuple[int, int, int, int], rows: tuple[int, int],
             positions: tuple[np.ndarray, np.ndarray] | None) -> tuple[int, int]:
    """Key rows ``[k0, k1)`` of sequence ``seq`` holding every key a query of ``rows`` can see: a window or
    chunk bounds them below, causality above (``positions`` from ``host_positions``; None: every key), so a
    windowed layer's explicit form costs about ``rows x window``, not ``rows x lk``."""
    qa, qb, ka, kb = seq
    ra, rb = rows
    if positions is None or rb <= ra:
        return ka, kb
    pos_q, pos_k = positions
    feats = spec.features
    first, last = int(pos_q[ra - qa]), int(pos_q[rb - 1 - qa])
    low = first - feats.window + 1 if feats.window is not None else 0
    if feats.chunk is not None:
        low = max(low, first // feats.chunk * feats.chunk)
    return ka + int(np.searchsorted(pos_k, low, "left")), ka + int(np.searchsorted(pos_k, last, "right"))


def reach_span(spec: LseSpec) -> int | None:
    """Most keys one query can see under the layer's window or chunk (None: unbounded)."""
    feats = spec.features
    spans = [x for x in ((feats.window, feats.chunk) if feats is not None else ()) if x is not None]
    return min(spans) if spans else None


def row_tiles(seq: tuple[int, int, int, int], heads: int, budget: int | None = None,
              span: int | None = None) -> list[tuple[int, int]]:
    """The query rows of one sequence in tiles whose ``[heads, rows, keys]`` fp32 scores (and the few
    same-sized temporaries beside them) fit ``budget`` bytes (default ``TILE_BYTES``): the explicit
    form's memory is bounded by the tile, not by ``lq x lk`` (a ring block of a 2M-token context has tens
    of thousands of rows a side). ``span``: each row sees at most this many keys (banded by ``key_band``):
    tiles of about ``span`` rows (at least ``MIN_BAND_ROWS``), each seeing at most ``rows + span`` keys, so
    the work is at most about twice the window's pairs."""
    qa, qb, ka, kb = seq
    cap = max(1, (TILE_BYTES if budget is None else budget) // (heads * 4 * _TEMPORARIES))
    lk = max(1, kb - ka)
    step = max(1, cap // lk)
    if span is not None:
        step = max(MIN_BAND_ROWS, span)
        if step * min(lk, step + span) > cap:
            step = max(1, cap // min(lk, step + span))
    return [(a, min(a + step, qb)) for a in range(qa, qb, step)]


def _explicit_scores(q, kr, spec: LseSpec, seq: tuple[int, int, int, int], rows: tuple[int, int],
                     keys: tuple[int, int], ct):
    """``([heads, rows, keys]`` scores of query rows ``rows`` against key rows ``keys`` of one sequence in
    ``ct``, soft-capped and masked; ``d capped / d raw`` or None). ``kr``: the sequence's keys, kv heads
    repeated to the query heads, in ``ct``."""
    ra, rb = rows
    k0, k1 = (x - seq[2] for x in keys)
    scores = torch.einsum("qhd,khd->hqk", q[ra:rb].to(ct), kr[k0:k1]) * spec.scale
    dcap = None
    if spec.features is not None:
        scores, dcap = spec.features.cap(scores)
    seen = _seen(spec, seq, rows, keys, q.device)
    if seen is not None:
        scores = scores.masked_fill(~seen, -math.inf)
    return scores, dcap


def each_forward(q, k, v, spec: LseSpec):
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
        group = heads // k.shape[1]
        kr, vr = (t[ka:kb].repeat_interleave(group, dim=1).to(ct) for t in (k, v))
        positions = host_positions(spec, (qa, qb, ka, kb))
        span = reach_span(spec) if positions is not None else None
        for ra, rb in row_tiles((qa, qb, ka, kb), heads, span=span):
            k0, k1 = key_band(spec, (qa, qb, ka, kb), (ra, rb), positions)
            if k1 <= k0:
                continue                                   # no key in reach: rows stay (0, -inf)
            scores, _ = _explicit_scores(q, kr, spec, (qa, qb, ka, kb), (ra, rb), (k0, k1), ct)
            row = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - finite(row)[..., None])
            out[ra:rb] = torch.einsum("hqk,khd->qhd", probs, vr[k0 - ka:k1 - ka]).to(q.dtype)
            lse[:, ra:rb] = row
    return out, lse


def each_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
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
        kr = k[ka:kb].repeat_interleave(group, dim=1).to(ct)
        vr = v[ka:kb].repeat_interleave(group, dim=1).to(ct)
        positions = host_positions(spec, (qa, qb, ka, kb))
        span = reach_span(spec) if positions is not None else None
        for ra, rb in row_tiles((qa, qb, ka, kb), heads, span=span):
            k0, k1 = key_band(spec, (qa, qb, ka, kb), (ra, rb), positions)
            if k1 <= k0:
                continue                                   # no key in reach: no gradient
            band = slice(k0 - ka, k1 - ka)
            scores, dcap = _explicit_scores(q, kr, spec, (qa, qb, ka, kb), (ra, rb), (k0, k1), ct)
            probs = torch.exp(scores - finite(lse[:, ra:rb].to(ct))[..., None])          # masked keys: 0
            do = dout[ra:rb].to(ct)
            delta = (do * out[ra:rb].to(ct)).sum(-1).t()                                    # [heads, rows]
            if dlse is not None:
                delta = delta - dlse[:, ra:rb].to(ct)
            dscores = probs * (torch.einsum("qhd,khd->hqk", do, vr[band]) - delta[..., None])
            if dcap is not None:
                dscores = dscores * dcap                                                    # through the softcap
            dq[ra:rb] = torch.einsum("hqk,khd->qhd", dscores, kr[band]) * spec.scale
            dk[k0:k1] += (torch.einsum("hqk,qhd->khd", dscores, q[ra:rb].to(ct)) * spec.scale).unflatten(
                1, (kv_heads, group)).sum(2)
            dv[k0:k1] += torch.einsum("hqk,qhd->khd", probs, do).unflatten(1, (kv_heads, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
