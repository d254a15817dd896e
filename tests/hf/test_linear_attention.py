"""Gated DeltaNet (linear attention) under FlexSP's Ulysses.

4 gloo ranks, the heterogeneous family plan (degrees 4, 2, 1; padded shards), fp64 weights: Qwen3.5 and
Qwen3-Next hybrids (a linear and a full attention layer each; Qwen3-Next with its router loss on) take one
SGD step equal to the native model run sequence by sequence. One process: the per-sequence runner restarts
at every sequence (never reads a neighbour or padding) with zero output and gradient on padding rows; a
hostile varlen stand-in (garbage in the rows it does not own, another dtype) gives the same; rings and
degrees that do not divide the value heads are refused in one line."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf.family_runs import assert_exact, family_results  # noqa: E402

from flexsp.hf import UnsupportedModelError, prepare_model  # noqa: E402
from flexsp.hf.families import LENGTHS, batch, tiny_model  # noqa: E402
from flexsp.hf.linear_attention import make_varlen  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402
from flexsp.runtime.sp.context import ShardingError  # noqa: E402
from flexsp.runtime.sp.linear import check_linear_heads, ulysses_conv, ulysses_recurrence  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_next+router-loss")


@pytest.fixture(scope="module")
def results():
    return family_results(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hybrid_trains_exactly(results, model_type):
    assert_exact(results, model_type)


def test_every_layer_mixes_under_sp():
    sp = prepare_model(tiny_model("qwen3_5"), max_seqlen=max(LENGTHS))
    assert sp.mixers == ("softmax attention", "linear attention (Gated DeltaNet)")
    kinds = sp.model.config.get_text_config().layer_types
    assert sorted(set(kinds)) == ["full_attention", "linear_attention"]


def _rule():
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    original = getattr(m.torch_chunk_gated_delta_rule, "_flexsp_original", m.torch_chunk_gated_delta_rule)
    return lambda q, k, v, g, b: original(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True)[0]


def _inputs(rows, gen, key_heads=2, value_heads=4, dim=8):
    q = torch.randn(rows, key_heads, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(rows, key_heads, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(rows, value_heads, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    g = (-torch.rand(rows, value_heads, dtype=torch.float64, generator=gen)).requires_grad_()
    beta = torch.rand(rows, value_heads, dtype=torch.float64, generator=gen).requires_grad_()
    return q, k, v, g, beta


def test_recurrence_restarts_per_sequence_and_zeroes_padding():
    gen = torch.Generator().manual_seed(0)
    bounds, rows = (0, 5, 12, 15), 18   # three sequences, three padding rows
    inputs = _inputs(rows, gen)
    ctx = AttentionContext.packed(bounds)
    out = ulysses_recurrence(*inputs, ctx, _rule())
    rule = _rule()
    for a, b in zip(bounds[:-1], bounds[1:]):   # each sequence alone, from a fresh state
        alone = rule(*(t[a:b][None] for t in inputs))[0]
        assert torch.allclose(out[a:b], alone, rtol=0, atol=1e-6)   # the recurrence runs in fp32 (transformers')
    assert torch.equal(out[15:], torch.zeros_like(out[15:]))
    out.sum().backward()
    for t in inputs:
        assert torch.equal(t.grad[15:], torch.zeros_like(t.grad[15:]))   # padding rows: no gradient
        assert float(t.grad[:15].abs().max()) > 0


class _UnwrittenGradients(torch.autograd.Function):
    """A varlen kernel's backward as flash-linear-attention's may leave it on CUDA (its gradient buffers are
    ``empty``): every gradient row past ``cu_seqlens[-1]`` unwritten, NaN here. The real rows' gradients are
    those of ``compute`` (autograd through it)."""

    @staticmethod
    def forward(ctx, end, compute, *xs):
        with torch.enable_grad():
            ctx.inner = [x.detach().requires_grad_() for x in xs]
            ctx.out = compute(*ctx.inner)
        ctx.end = end
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad):
        grads = torch.autograd.grad(ctx.out, ctx.inner, grad)
        grads = [g.clone() for g in grads]
        for g in grads:
            g[:, ctx.end:] = float("nan")          # [1, tokens, ...]: the rows the kernel does not own
        return (None, None, *grads)


def test_hostile_varlen_kernel():
    """A stand-in for flash-linear-attention's varlen kernel that, as a CUDA kernel may, leaves garbage in
    the rows outside cu_seqlens, in its output and in every gradient it returns, and returns fp32: the output
    and the gradients equal the per-length path's."""
    rule = _rule()
    seen = []

    def hostile(q, k, v, g=None, beta=None, cu_seqlens=None, use_qk_l2norm_in_kernel=True, **_):
        seen.append(cu_seqlens)
        cu = cu_seqlens.tolist()

        def compute(*xs):
            out = torch.full(xs[2].shape, float("nan"), dtype=torch.float32)
            parts = [rule(*(t[:, a:b] for t in xs)).float() for a, b in zip(cu[:-1], cu[1:])]
            return torch.cat([torch.cat(parts, dim=1), out[:, cu[-1]:]], dim=1)

        return _UnwrittenGradients.apply(cu[-1], compute, q, k, v, g, beta), None

    gen = torch.Generator().manual_seed(1)
    bounds, rows = (0, 7, 9, 14), 16
    a = _inputs(rows, gen)
    b = [t.detach().clone().requires_grad_() for t in a]
    ctx = AttentionContext.packed(bounds)
    want = ulysses_recurrence(*a, ctx, rule)
    got = ulysses_recurrence(*b, ctx, rule, varlen=make_varlen(hostile, True))
    assert got.dtype == want.dtype and not torch.isnan(got).any()
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    for x, y in zip(a, b):
        assert not torch.isnan(y.grad).any() and torch.equal(y.grad[14:], torch.zeros_like(y.grad[14:]))
        assert torch.allclose(x.grad, y.grad, rtol=0, atol=1e-5)
    # every layer of a micro-batch hands the kernel one int64 bounds tensor (fla's caches are keyed on it)
    ulysses_recurrence(*b, ctx, rule, varlen=make_varlen(hostile, True))
    assert seen[0] is seen[1] and seen[0].dtype == torch.int64


def test_conv_restarts_per_sequence():
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(2)
    bounds, rows, channels = (0, 4, 10), 12, 6
    x = torch.randn(rows, channels, dtype=torch.float64, generator=gen)
    w = torch.randn(channels, 3, dtype=torch.float64, generator=gen)

    def local(xs, weight, bias):   # [n, L, C] -> [n, L, C], causal depthwise
        y = F.conv1d(xs.transpose(1, 2), weight[:, None], bias, padding=2, groups=channels)[:, :, :xs.shape[1]]
        return y.transpose(1, 2)

    out = ulysses_conv(x, [w, None], AttentionContext.packed(bounds), local)
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert torch.allclose(out[a:b], local(x[a:b][None], w, None)[0])
    assert torch.equal(out[10:], torch.zeros_like(out[10:]))


def test_rings_and_indivisible_heads_refused():
    sp = prepare_model(tiny_model("qwen3_5"), max_seqlen=max(LENGTHS))
    p = pack(batch()[:2], 1)
    ring_ctx = dataclasses.replace(AttentionContext.packed(p.cu_seqlens), ring=object())
    with pytest.raises(UnsupportedModelError, match="cannot be split over a ring group exactly"):
        sp(p.input_ids, p.position_ids, ring_ctx)
    with pytest.raises(ShardingError, match="SP degree 3 does not divide its 4 value heads"):
        check_linear_heads(4, 3)
