"""Local attention kernels agree with a per-sequence reference, respect bounds, ignore padding, return an
exact log-sum-exp whose partials merge into full attention, and never read device bounds on the host."""
import math

import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.kernels import (
    AttentionError,
    LseSpec,
    attend,
    attend_lse,
    flash_available,
    lse_backward,
    lse_forward,
    merge_partials,
    reference,
    resolve_backend,
    varlen_available,
)

TOL = dict(rtol=1e-10, atol=1e-12)


def _qkv(tokens, heads, kv_heads, dim=8, dtype=torch.float64, device="cpu", seed=0, tokens_k=None):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, dim, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    tk = tokens if tokens_k is None else tokens_k
    return make(tokens, heads).requires_grad_(), make(tk, kv_heads).requires_grad_(), make(tk, kv_heads).requires_grad_()


def _weights(shape, seed, like):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(like)


def _run(backend, q, k, v, cu, seed=1, **kw):
    out = attend(q, k, v, cu, backend=backend, **kw)
    grads = torch.autograd.grad((out * _weights(out.shape, seed, out)).sum(), (q, k, v))
    return out, grads


def _run_lse(backend, q, k, v, cu_q, cu_k, causal, seed=2):
    out, lse = attend_lse(q, k, v, cu_q, cu_k, causal=causal, backend=backend)
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)     # -inf rows carry no gradient either way
    loss = (out * _weights(out.shape, seed, out)).sum() + (finite_lse * _weights(lse.shape, seed + 1, lse)).sum()
    return out, lse, torch.autograd.grad(loss, (q, k, v))


def _close(a, b, **tol):
    torch.testing.assert_close(a, b, **(tol or TOL))


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_each"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_sdpa_matches_reference_forward_and_backward(heads, kv_heads, as_tensor, backend):
    q, k, v = _qkv(15, heads, kv_heads)
    cu = (0, 6, 7, 7, 13)                    # four sequences (one empty), then two padding tokens
    given = torch.tensor(cu, dtype=torch.int32) if as_tensor else cu
    out_s, grads_s = _run(backend, q, k, v, given, max_seqlen=6)
    out_r, grads_r = _run("reference", q, k, v, cu)
    _close(out_s, out_r)
    for a, b in zip(grads_s, grads_r):
        _close(a, b)
    assert (out_s[13:] == 0).all() and (grads_s[0][13:] == 0).all() and (grads_s[1][13:] == 0).all()


def test_no_attention_across_sequences():
    q, k, v = _qkv(10, 2, 2)
    packed = attend(q, k, v, (0, 4, 10), backend="sdpa")
    alone = torch.cat([attend(q[:4], k[:4], v[:4], (0, 4), backend="reference"),
                       attend(q[4:], k[4:], v[4:], (0, 6), backend="reference")])
    _close(packed, alone)
    # Causal: changing a later token of sequence 0 leaves earlier outputs alone.
    k2 = k.detach().clone()
    k2[3] += 1.0
    _close(attend(q, k2, v, (0, 4, 10), backend="sdpa")[:3], packed[:3])


CASES = [  # (tokens_q, tokens_k, cu_q, cu_k, causal)
    (15, 15, (0, 6, 7, 13), (0, 6, 7, 13), True),             # equal lengths, padding rows
    (12, 9, (0, 5, 5, 12), (0, 3, 4, 9), False),             # unequal lengths, an empty query sequence
    (11, 8, (0, 4, 11), (0, 0, 8), False),                   # a query sequence with no keys: lse -inf
    (9, 12, (0, 3, 9), (0, 5, 12), True),                    # causal, bottom-right aligned, Lk > Lq
    (10, 7, (0, 6, 10), (0, 4, 7), True),                    # causal with Lq > Lk: early rows see nothing
]


@pytest.mark.parametrize("tq,tk,cu_q,cu_k,causal", CASES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attend_lse_matches_reference_through_both_outputs(tq, tk, cu_q, cu_k, causal, kv_heads):
    q, k, v = _qkv(tq, 4, kv_heads, tokens_k=tk)
    out_s, lse_s, grads_s = _run_lse("sdpa", q, k, v, torch.tensor(cu_q, dtype=torch.int32), cu_k, causal)
    out_r, lse_r, grads_r = _run_lse("reference", q, k, v, cu_q, cu_k, causal)
    _close(out_s, out_r)
    assert torch.equal(torch.isinf(lse_s), torch.isinf(lse_r))
    _close(torch.where(torch.isinf(lse_s), 0.0, lse_s), torch.where(torch.isinf(lse_r), 0.0, lse_r))
    for a, b in zip(grads_s, grads_r):
        _close(a, b)
    assert lse_s.shape == (4, tq) and lse_s.dtype == torch.float64
    assert (lse_s[:, cu_q[-1]:] == -math.inf).all() and (out_s[cu_q[-1]:] == 0).all()


def test_lse_is_the_log_normaliser():
    q, k, v = _qkv(6, 2, 2)
    _, lse = attend_lse(q, k, v, (0, 6), (0, 6), causal=False, backend="sdpa")
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    _close(lse, torch.log(torch.exp(scores).sum(-1)))


def _split_keys(tokens_k, cut):
    """Keys of each of two sequences split into a front and a back part (disjoint, covering all)."""
    return (0, cut[0], tokens_k // 2 + cut[1]), (0, tokens_k // 2 - cut[0], tokens_k - tokens_k // 2 - cut[1])


def test_merged_partials_equal_full_attention_forward_and_backward():
    q, k, v = _qkv(9, 4, 2, tokens_k=12)
    cu_q, cu_k = (0, 4, 9), (0, 6, 12)
    full, full_lse = attend_lse(q, k, v, cu_q, cu_k, causal=False, backend="reference")
    # Front part of each sequence's keys: k[0:2] and k[6:9]; back part: k[2:6] and k[9:12].
    front, back = torch.tensor([0, 1, 6, 7, 8]), torch.tensor([2, 3, 4, 5, 9, 10, 11])
    out_a, lse_a = attend_lse(q, k[front], v[front], cu_q, (0, 2, 5), causal=False, backend="sdpa")
    out_b, lse_b = attend_lse(q, k[back], v[back], cu_q, (0, 4, 7), causal=False, backend="sdpa")
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    _close(out, full)
    _close(lse, full_lse)
    w = _weights(out.shape, 3, out)
    got = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v))
    want = torch.autograd.grad((full * w).sum() + full_lse.sum(), (q, k, v))
    for a, b in zip(got, want):
        _close(a, b)


def test_merge_is_stable_and_keeps_empty_rows_empty():
    out_a, out_b = torch.ones(3, 1, 2), 3 * torch.ones(3, 1, 2)
    lse_a = torch.tensor([[1e4, -math.inf, -math.inf]])
    lse_b = torch.tensor([[1e4, 5.0, -math.inf]])
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    _close(out[0], 2 * torch.ones(1, 2), rtol=0, atol=0)                        # equal weights, no overflow
    assert lse[0, 0].item() == pytest.approx(1e4 + math.log(2))
    _close(out[1], out_b[1], rtol=0, atol=0)
    assert lse[0, 1].item() == 5.0 and lse[0, 2].item() == -math.inf and (out[2] == 0).all()
    a = lse_a.clone().requires_grad_()
    merged, merged_lse = merge_partials(out_a, a, out_b, lse_b)
    (grad,) = torch.autograd.grad(merged.sum() + torch.where(torch.isinf(merged_lse), 0.0, merged_lse).sum(), a)
    assert torch.isfinite(grad).all()


def test_partial_backward_with_merged_statistics_sums_to_full_gradient():
    """The ring's backward: each key block's gradient from the merged (out, lse), summed, is exact."""
    q, k, v = _qkv(10, 4, 2)
    cu = (0, 10)
    full, _ = attend_lse(q, k, v, cu, cu, causal=True, backend="reference")
    dout = _weights(full.shape, 4, full)
    want = torch.autograd.grad((full * dout).sum(), (q, k, v))
    # Block 1: queries 4..9 see keys 0..3 fully; block 2: all queries, keys 4..9 causally (bottom-right).
    spec_a = LseSpec(torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), 6, 4, False,
                     1 / math.sqrt(8), "sdpa")
    spec_b = LseSpec(torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32), 6, 6, True,
                     1 / math.sqrt(8), "sdpa")
    spec_c = LseSpec(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32), 4, 4, True,
                     1 / math.sqrt(8), "sdpa")
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    oa, la = lse_forward(qd[4:], kd[:4], vd[:4], spec_a)
    ob, lb = lse_forward(qd[4:], kd[4:], vd[4:], spec_b)
    oc, lc = lse_forward(qd[:4], kd[:4], vd[:4], spec_c)
    o_hi, l_hi = merge_partials(oa, la, ob, lb)
    out = torch.cat([oc, o_hi])
    _close(out, full.detach())
    ga = lse_backward(dout[4:], qd[4:], kd[:4], vd[:4], o_hi, l_hi, spec_a)
    gb = lse_backward(dout[4:], qd[4:], kd[4:], vd[4:], o_hi, l_hi, spec_b)
    gc = lse_backward(dout[:4], qd[:4], kd[:4], vd[:4], oc, lc, spec_c)
    dq = torch.cat([gc[0], ga[0] + gb[0]])
    dk = torch.cat([gc[1] + ga[1], gb[1]])
    dv = torch.cat([gc[2] + ga[2], gb[2]])
    for a, b in zip((dq, dk, dv), want):
        _close(a, b)


def test_device_bounds_are_never_read_on_the_host():
    """On the meta device any .tolist()/.item()/int() raises: given host bounds, the per-sequence kernels
    run on shapes alone; without them they refuse (a clear error, not a sync per layer)."""
    meta = lambda *shape: torch.empty(*shape, device="meta", requires_grad=True)  # noqa: E731
    q, k, v = meta(15, 4, 8), meta(15, 2, 8), meta(15, 2, 8)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    host = (0, 6, 7, 13)
    out = attend(q, k, v, cu, max_seqlen=6, backend="sdpa", bounds=host)
    out.sum().backward()
    out, lse = attend_lse(q, k, v, cu, cu, max_seqlen_q=6, max_seqlen_k=6, causal=True, backend="sdpa",
                          bounds_q=host, bounds_k=host)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and lse.shape == (4, 15)
    with pytest.raises(AttentionError, match="needs cu_seqlens as host ints"):
        attend(q, k, v, cu, max_seqlen=6, backend="sdpa")
    with pytest.raises(AttentionError, match="max_seqlen_k is required with device cu_seqlens"):
        attend_lse(q, k, v, cu, cu, max_seqlen_q=6, causal=False, backend="sdpa")


def test_backend_selection_and_errors():
    q, k, v = _qkv(4, 2, 2)
    assert resolve_backend("auto", q) == "sdpa"   # float64 never picks a flash kernel
    with pytest.raises(AttentionError, match="unknown attention backend 'tiled'"):
        attend(q, k, v, (0, 4), backend="tiled")
    with pytest.raises(AttentionError, match="cu_seqlens must rise from 0 to at most 4 tokens"):
        attend(q, k, v, (0, 5), backend="sdpa")
    with pytest.raises(AttentionError, match="cu_seqlens_k must rise"):
        attend_lse(q, k, v, (0, 4), (0, 3, 2), causal=False, backend="sdpa")
    with pytest.raises(AttentionError, match="cu_seqlens_q has 1 sequences but cu_seqlens_k has 2"):
        attend_lse(q, k, v, (0, 4), (0, 2, 4), causal=False, backend="sdpa")
    with pytest.raises(AttentionError, match="3 query heads are not a multiple of 2 kv heads"):
        attend(*_qkv(4, 3, 2), (0, 4))
    with pytest.raises(ValueError):     # the family is catchable as ValueError, as before
        attend(q, k[:3], v[:3], (0, 4), backend="sdpa")
    if not flash_available():
        with pytest.raises(AttentionError, match="'flash' needs flash_attn installed and CUDA"):
            attend(q, k, v, (0, 4), backend="flash")
    if not varlen_available():
        with pytest.raises(AttentionError, match="'varlen' needs CUDA tensors in float16/bfloat16"):
            attend(q, k, v, (0, 4), backend="varlen")


needs_cuda = pytest.mark.skipif(not varlen_available(), reason="torch varlen_attn needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("backend", ["varlen", "flash"])
def test_cuda_attend_matches_reference(heads, kv_heads, backend):
    if backend == "flash" and not flash_available():
        pytest.skip("flash-attn is not installed")
    q, k, v = _qkv(37, heads, kv_heads, dim=64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor((0, 20, 21, 35), dtype=torch.int32, device="cuda")
    out_f, grads_f = _run(backend, q, k, v, cu, max_seqlen=20)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_r, grads_r = _run("reference", q64, k64, v64, cu.cpu())
    _close(out_f.double(), out_r, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_f, grads_r):
        _close(a.double(), b, rtol=5e-2, atol=5e-2)


@needs_cuda
@pytest.mark.parametrize("tq,tk,cu_q,cu_k,causal", CASES)
def test_cuda_attend_lse_matches_reference_on_the_same_chunks(tq, tk, cu_q, cu_k, causal):
    q, k, v = _qkv(tq, 4, 2, dim=64, dtype=torch.bfloat16, device="cuda", tokens_k=tk)
    dev = lambda cu: torch.tensor(cu, dtype=torch.int32, device="cuda")  # noqa: E731
    lengths = lambda cu: max(b - a for a, b in zip(cu, cu[1:]))  # noqa: E731
    out, lse = attend_lse(q, k, v, dev(cu_q), dev(cu_k), max_seqlen_q=lengths(cu_q), max_seqlen_k=lengths(cu_k),
                          causal=causal, backend="varlen")
    finite = torch.where(torch.isinf(lse), 0.0, lse)
    loss = (out.double() * _weights(out.shape, 2, out.double())).sum() + (finite.double() * _weights(lse.shape, 3, lse.double())).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_r, lse_r, grads_r = _run_lse("reference", q64, k64, v64, cu_q, cu_k, causal)
    _close(out.double(), out_r, rtol=2e-2, atol=2e-2)
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(lse_r).cpu())
    _close(finite.double(), torch.where(torch.isinf(lse_r), 0.0, lse_r), rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, grads_r):
        _close(a.double(), b, rtol=5e-2, atol=5e-2)
