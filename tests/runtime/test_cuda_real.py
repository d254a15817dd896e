"""The CUDA paths on a real GPU (skipped without one; ``scripts/gpu_check.sh`` runs this file by name).

Imports only torch, pytest and flexsp, so it runs on a bare GPU box. Each check compares with a float64
reference or an exact identity, after poisoning the allocator (a large NaN block freed just before), so
rows a kernel never writes show as NaN rather than as the zeros a fresh allocation may happen to hold.
"""
import inspect
import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from flexsp.runtime.kernels import Features, attend, attend_lse, reference, resolve_backend  # noqa: E402
from flexsp.runtime.kernels import ran, rule, varlen  # noqa: E402
from flexsp.runtime.poison import poison_allocator  # noqa: E402

BF16 = torch.bfloat16


def _qkv(rows, heads=8, kv_heads=2, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, h, dim, generator=g, dtype=torch.float64).cuda() for h in (heads, kv_heads, kv_heads)]


def _check(bounds, rows, backend, lse=False, features=None, sink=False):
    base = _qkv(rows)
    if sink:   # per-head sink logits: a leaf of their own, their gradient checked like q/k/v's
        base.append(torch.randn(base[0].shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64).cuda())
    dev = [t.to(BF16).requires_grad_() for t in base]
    ref = [t.clone().requires_grad_() for t in base]
    cu = torch.tensor(bounds, dtype=torch.int32).cuda()
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    poison_allocator(torch.device("cuda"))
    if lse:
        run = lambda: attend_lse(*dev, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True,  # noqa: E731
                                 backend=backend, bounds_q=bounds, bounds_k=bounds)[0]
        want = reference(*ref, bounds, bounds, causal=True)
    else:
        f = features or Features()
        run = lambda: attend(*dev[:3], cu, max_seqlen=longest, backend=backend, bounds=bounds,  # noqa: E731
                             features=f, sinks=dev[3] if sink else None)
        want = reference(*ref[:3], bounds, window=f.window, chunk=f.chunk, softcap=f.softcap,
                         sinks=ref[3] if sink else None)
    out, fwd = ran.kernels_in(run)
    dout = torch.randn(out.shape, dtype=torch.float64, device="cuda")
    grads, bwd = ran.kernels_in(lambda: torch.autograd.grad((out.double() * dout).sum(), dev))
    fwd, bwd = fwd["forward"], bwd["backward"]
    wants = torch.autograd.grad((want * dout).sum(), ref)
    real = bounds[-1]
    for name, got, exp in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (want, *wants)):
        if name == "dsinks":   # per head, not per row: no padding rows to check
            got, exp, real = got[None], exp[None], 1
        assert bool((got[real:] == 0).all()), f"{name}: padding rows are not exactly zero"
        # bf16: within 3% of the largest reference entry (a one-token sequence's dq/dk are exactly 0)
        diff, scale = float((got[:real].double() - exp[:real]).abs().max()), float(exp[:real].abs().max())
        assert diff <= 3e-2 * scale + 1e-2, f"{name}: off by {diff:.3g}, largest reference entry {scale:.3g}"
    return fwd, bwd


@pytest.mark.parametrize("lse", [False, True], ids=["attend", "attend_lse"])
@pytest.mark.parametrize("bounds,rows", [((0, 1500, 1501, 2600), 3072), ((0, 1), 64), ((0, 100, 128), 192)],
                         ids=["long", "idle dummy", "128 tokens"])
def test_auto_kernel_exact_padding_zero_and_recorded(bounds, rows, lse):
    fwd, bwd = _check(bounds, rows, "auto", lse)
    facts = rule.device_facts("cuda")
    kernel = resolve_backend("auto", torch.empty(1, 8, 128, dtype=BF16, device="cuda"), bounds)
    print(f"auto -> {kernel}: {ran.describe({'forward': fwd, 'backward': bwd})} (selects: {facts.varlen_selects}, cuDNN {facts.cudnn})")
    assert fwd and bwd, "no attention kernel seen by the profiler"
    if kernel.startswith("varlen") or lse:
        assert fwd == bwd, f"the backward ran on another backend: {ran.describe({'forward': fwd, 'backward': bwd})}"
    if facts.varlen_selects and max(b - a for a, b in zip(bounds, bounds[1:])) <= varlen.CUDNN_MIN_Q:
        assert "cudnn" not in fwd + bwd


@pytest.mark.parametrize("sink", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("features", [Features(window=257), Features(chunk=512), Features(softcap=30.0),
                                      Features(window=129, softcap=50.0), Features()],
                         ids=["window", "chunk", "softcap", "window+softcap", "plain"])
def test_attention_features_on_the_auto_kernel_exact_and_padding_zero(features, sink):
    """Sliding windows, chunks, softcaps and sinks (Gemma, Llama 4, gpt-oss layers) on whichever kernel ``auto``
    gives this torch, in bf16 after a poisoned allocator, against the float64 reference."""
    fwd, bwd = _check((0, 1500, 1501, 2600), 3072, "auto", features=features, sink=sink)
    print(f"{features} sinks={sink}: {ran.describe({'forward': fwd, 'backward': bwd})}")


@pytest.mark.parametrize("bounds,rows", [((0, 1), 64), ((0, 1500, 2600), 2688)], ids=["idle dummy", "long"])
def test_varlen_cudnn_where_offered_never_raises_and_backward_matches_forward(bounds, rows):
    facts = rule.device_facts("cuda")
    if not facts.cudnn_varlen:
        pytest.skip(f"varlen_cudnn is not offered here: needs {facts.cudnn_missing()}")
    fwd, bwd = _check(bounds, rows, "varlen_cudnn")
    assert fwd == bwd, ran.describe({'forward': fwd, 'backward': bwd})
    if bounds[-1] <= varlen.CUDNN_MIN_Q:
        assert fwd == ["flash"]


def test_weight_gradient_accumulates_in_fp32_by_the_out_dtype_matmul_where_it_runs():
    from flexsp.runtime.models.loss import accumulate_outer, has_out_dtype_matmul
    g = torch.Generator().manual_seed(1)
    gr, h = torch.randn(64, 96, generator=g), torch.randn(64, 32, generator=g)
    acc = torch.randn(96, 32, generator=g)
    want = acc.double() + gr.to(BF16).double().t() @ h.to(BF16).double()
    got = acc.cuda()
    accumulate_outer(got, gr.to(BF16).cuda(), h.to(BF16).cuda())
    fused = has_out_dtype_matmul(got.device)
    print(f"out_dtype matmul: {fused}")
    assert got.dtype == torch.float32
    if fused:    # bf16 products summed in fp32 by the matmul itself
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-4)
    else:        # blocks of bf16 products added to the fp32 accumulator
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=5e-2)


def test_library_loss_matches_the_own_loss():
    from flexsp.runtime.models import fused_loss
    from flexsp.runtime.models.loss import linear_cross_entropy
    if fused_loss.library_function() is None:
        pytest.skip("liger-kernel is not installed (the gpu extra)")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(300, 64, generator=g).cuda().requires_grad_()
    weight = (torch.randn(1000, 64, generator=g) / math.sqrt(64)).cuda().requires_grad_()
    labels = torch.randint(0, 1000, (300,), generator=g).cuda()
    labels[::7] = -100
    with torch.autocast("cuda", dtype=BF16):
        mine = fused_loss.lm_head_loss(hidden, weight, None, labels, kernel="liger")
        own = linear_cross_entropy(hidden, weight, None, labels)
    got = torch.autograd.grad(mine, (hidden, weight))
    want = torch.autograd.grad(own, (hidden, weight))
    assert mine.dtype == torch.float32
    torch.testing.assert_close(mine, own, rtol=2e-3, atol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-3)


def test_flash_linear_attention_matches_the_per_sequence_recurrence_with_padding_zero():
    """Qwen3.5/Qwen3-Next's Gated DeltaNet through flash-linear-attention's varlen kernel (``flexsp.hf``'s
    path on CUDA), bf16 q/k/v after a poisoned allocator, against transformers' own recurrence run per
    sequence in float64: output and every gradient, padding rows exactly 0 (fla leaves them unwritten)."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    m = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from flexsp.hf.linear_attention import fla_varlen
    # the torch recurrence itself: with fla installed, transformers' name dispatches to fla (bf16 only)
    torch_rule = inspect.unwrap(getattr(m.torch_chunk_gated_delta_rule, "_flexsp_original", m.torch_chunk_gated_delta_rule))
    kernel = fla_varlen(torch.device("cuda"), True)
    assert kernel is not None, "fla is installed but flexsp.hf.linear_attention does not take its kernel"
    _gated_deltanet_check(kernel, torch_rule, torch.device("cuda"))


def _gated_deltanet_check(kernel, torch_rule, device, bounds=(0, 1500, 1501, 2600), rows=3072):
    from flexsp.runtime import AttentionContext
    from flexsp.runtime.sp.linear import ulysses_recurrence
    g = torch.Generator().manual_seed(4)
    shapes = ((rows, 2, 64), (rows, 2, 64), (rows, 4, 64), (rows, 4), (rows, 4))
    base = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    base[3] = -torch.rand(shapes[3], generator=g, dtype=torch.float64)          # log decay, as the model's g
    base[4] = torch.rand(shapes[4], generator=g, dtype=torch.float64)           # beta in (0, 1)
    base = [t.to(device) for t in base]
    # the model's dtypes: q/k/v and beta in bf16, g in fp32
    dev = [t.to(torch.float32 if i == 3 else BF16).requires_grad_() for i, t in enumerate(base)]
    ref = [t.clone().requires_grad_() for t in base]
    ctx = AttentionContext.packed(bounds, device)   # its bounds on the device, as the runtime builds them
    local = lambda q, k, v, gg, b: torch_rule(q, k, v, g=gg, beta=b, use_qk_l2norm_in_kernel=True)[0]  # noqa: E731
    want = ulysses_recurrence(*ref, ctx, local)
    poison_allocator(device)
    out = ulysses_recurrence(*dev, ctx, local, varlen=kernel)
    real = bounds[-1]
    _close("out", out.detach(), want.detach(), real)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device)
    try:
        grads = torch.autograd.grad((out.double() * dout).sum(), dev)
    except RuntimeError as exc:   # fla 0.6 refuses its backward on Hopper with Triton < 3.7.1 (its issue #640)
        if "Triton" in str(exc):
            pytest.skip(f"flash-linear-attention refuses its backward on this box: {str(exc)[:160]}")
        raise
    wants = torch.autograd.grad((want * dout).sum(), ref)
    for name, got, exp in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, wants):
        _close(name, got, exp, real)


def _close(name, got, exp, real):
    """Padding rows exactly 0; the rest within 5% of the largest reference entry (bf16 through a recurrence)."""
    assert bool((got[real:] == 0).all()), f"{name}: padding rows are not exactly zero"
    diff, scale = float((got[:real].double() - exp[:real]).abs().max()), float(exp[:real].abs().max())
    print(f"gated deltanet {name}: max error {diff:.3g}, largest reference entry {scale:.3g}")
    assert diff <= 5e-2 * scale + 1e-2, f"{name}: off by {diff:.3g}, largest reference entry {scale:.3g}"
