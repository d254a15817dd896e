"""Which kernel runs: SDPA's fused CPU flash kernel per sequence (never the math kernel, never a T x T
mask), ``auto``'s choice by device/dtype/availability, and ``varlen_attn`` called right whatever
signature the installed torch has (each accepted signature stubbed, checked against the reference)."""
import inspect
import math

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flexsp.runtime.kernels as kernels  # noqa: E402
from flexsp.runtime.kernels import attend, attend_lse, reference, resolve_backend  # noqa: E402
from flexsp.runtime.kernels import flash as flash_mod, varlen as varlen_mod  # noqa: E402
from flexsp.runtime.kernels.varlen import VarlenAPI  # noqa: E402

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _qkv(tokens, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(tokens, h, dim, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _ops(fn):
    """(name, first input shape) of every aten op ``fn`` runs, forward and backward."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, tuple(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else ()) for e in prof.events()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sdpa_runs_the_fused_cpu_kernel_per_sequence(dtype):
    bounds = (0, 40, 64, 72, 80, 95)                        # two equal adjacent lengths batch into one call
    q, k, v = _qkv(97, dtype=dtype)                          # two padding tokens at the tail

    def step():
        out = attend(q, k, v, bounds, backend="sdpa")
        out.float().square().sum().backward()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):            # only the fused kernel allowed: math would raise
        step()
    ops = _ops(step)
    names = [n for n, _ in ops]
    assert MATH not in names
    shapes = sorted(s for n, s in ops if n == FLASH_CPU)
    assert shapes == sorted([(1, 4, 40, 16), (1, 4, 24, 16), (2, 4, 8, 16), (1, 4, 15, 16)])  # [n, heads, s, dim]
    assert f"{FLASH_CPU}_backward" in names
    # the largest attention-shaped tensor is one sequence's, never the pack's [T, T]
    assert not any(len(s) >= 2 and s[-1] == 97 and s[-2] == 97 for _, s in ops)


def test_three_d_inputs_would_not_dispatch_the_fused_kernel():
    """Why the 4-D views matter: the same call on 3-D tensors has no fused kernel (so the test above can fail)."""
    q, k, v = _qkv(16, heads=4, kv_heads=4)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True)


def test_ring_lse_path_uses_the_fused_cpu_kernel_and_matches_reference():
    q, k, v = _qkv(30, dtype=torch.float64)
    cu = (0, 12, 30)

    def run():
        out, lse = attend_lse(q, k, v, cu, cu, causal=True, backend="sdpa")
        (out.square().sum()).backward()
        return out, lse
    ops = [n for n, _ in _ops(run)]
    assert FLASH_CPU in ops and f"{FLASH_CPU}_backward" in ops and MATH not in ops
    out, lse = attend_lse(q, k, v, cu, cu, causal=True, backend="sdpa")
    want, want_lse = reference(q, k, v, cu, cu, causal=True, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)


def test_auto_picks_by_device_dtype_and_availability(monkeypatch):
    cpu_half = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert resolve_backend("auto", cpu_half) == "sdpa"
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda_bf16 = torch.empty(4, 2, 8, dtype=torch.bfloat16, device="cuda")
        cuda_fp32 = torch.empty(4, 2, 8, dtype=torch.float32, device="cuda")
    assert kernels.VARLEN is not None                          # torch 2.13 has a known signature
    assert resolve_backend("auto", cuda_bf16) == "varlen"
    assert resolve_backend("auto", cuda_fp32) == "sdpa"
    monkeypatch.setattr(varlen_mod, "VARLEN", None)            # an older torch, flash-attn installed
    monkeypatch.setattr(flash_mod, "FLASH", flash_mod.FlashAPI(object(), 2))
    assert resolve_backend("auto", cuda_bf16) == "flash"
    monkeypatch.setattr(flash_mod, "FLASH", None)
    assert resolve_backend("auto", cuda_bf16) == "sdpa"
    with pytest.raises(kernels.AttentionError, match="'varlen' needs CUDA"):
        resolve_backend("varlen", cuda_bf16)


# --- varlen_attn signatures -----------------------------------------------------------------------
class Aux:
    def __init__(self, lse: bool = False):
        self.lse = lse


def _attend(q, k, v, cu_q, cu_k, causal, scale=None):
    group = q.shape[1] // k.shape[1]
    return reference(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), cu_q.tolist(), cu_k.tolist(),
                     causal=causal, scale=scale, return_lse=True)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10/2.11: ``is_causal``, no ``scale`` / ``enable_gqa``, lse ``[tokens, heads]``."""
    assert key.shape[1] == query.shape[1], "no enable_gqa: kv heads must arrive repeated"
    out, lse = _attend(query, key, value, cu_seq_q, cu_seq_k, is_causal)
    return (out, lse.t()) if return_aux is not None and return_aux.lse else out


def varlen_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12+: ``window_size`` replaces ``is_causal``; ``scale``, ``enable_gqa``; lse ``[heads, tokens]``."""
    assert window_size in ((-1, 0), (-1, -1))
    assert enable_gqa or key.shape[1] == query.shape[1]
    out, lse = _attend(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def varlen_return_lse(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_lse=False, scale=None,
                      window_size=(-1, -1)):
    """A variant returning lse through a plain flag."""
    out, lse = _attend(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale)
    return (out, lse) if return_lse else out


def backward_2_10(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state):
    return _stub_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, is_causal, None)


def backward_2_12(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
                  scale=None, window_size=None):
    assert list(window_size) == ([-1, 0] if is_causal else [-1, -1])
    return _stub_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, is_causal, scale)


def _stub_backward(grad_out, query, key, value, cu_q, cu_k, causal, scale):
    q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
    out, _ = _attend(q, k, v, cu_q, cu_k, causal, scale)
    return torch.autograd.grad((out * grad_out).sum(), (q, k, v))


@pytest.mark.parametrize("fn,backward,causal_arg", [(varlen_2_10, backward_2_10, "is_causal"),
                                                    (varlen_2_12, backward_2_12, "window_size"),
                                                    (varlen_return_lse, backward_2_12, "window_size")])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_api_calls_each_signature_right(fn, backward, causal_arg, causal):
    api = VarlenAPI.detect(fn, Aux, backward)
    assert api is not None and api.causal_arg == causal_arg
    q, k, v = (t.detach().double() for t in _qkv(13, heads=4, kv_heads=2, dim=8))
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    scale = 0.3                                                 # not the default: 2.10 has no scale argument
    out, lse = api.forward(q, k, v, cu, cu, 8, 8, causal=causal, scale=scale, lse=True)
    want, want_lse = _attend(q, k, v, cu, cu, causal, scale)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse.float())
    assert lse.shape == (4, 13) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    grads = api.backward(dout, q, k, v, out, lse, cu, cu, 8, 8, causal=causal, scale=scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = _attend(qr, kr, vr, cu, cu, causal, scale)
    for got, exp in zip(grads, torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))):
        torch.testing.assert_close(got, exp)


def test_unknown_signature_is_not_used():
    def other(query, key, value, cu_seqlens, max_seqlen, causal=True):
        return query
    assert VarlenAPI.detect(other, Aux, None) is None
    assert VarlenAPI.detect(None) is None


def test_installed_torch_signature_is_detected():
    from torch.nn.attention import varlen
    api = kernels.VARLEN
    assert api is not None and api.fn is varlen.varlen_attn
    want = "window_size" if "window_size" in inspect.signature(varlen.varlen_attn).parameters else "is_causal"
    assert api.causal_arg == want and api.backward_op is not None and "lse" in api.backward_args
    assert math.isfinite(api.backward_args.index("max_k"))
