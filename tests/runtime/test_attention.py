"""Local attention backends agree, respect sequence boundaries and ignore padding."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.attention import attend, flash_available, resolve_backend  # noqa: E402


def _qkv(tokens, heads, kv_heads, dim=8, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(tokens, h, dim, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return make(heads).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_()


def _run(backend, q, k, v, cu, seed=1):
    out = attend(q, k, v, cu, backend=backend)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_matches_reference_forward_and_backward(heads, kv_heads):
    q, k, v = _qkv(15, heads, kv_heads)
    cu = (0, 6, 7, 13)                       # three sequences, then two padding tokens
    out_s, grads_s = _run("sdpa", q, k, v, cu)
    out_r, grads_r = _run("reference", q, k, v, cu)
    torch.testing.assert_close(out_s, out_r, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_s, grads_r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (out_s[13:] == 0).all() and (grads_s[0][13:] == 0).all() and (grads_s[1][13:] == 0).all()


def test_no_attention_across_sequences():
    q, k, v = _qkv(10, 2, 2)
    packed = attend(q, k, v, (0, 4, 10), backend="sdpa")
    alone = torch.cat([attend(q[:4], k[:4], v[:4], (0, 4), backend="reference"),
                       attend(q[4:], k[4:], v[4:], (0, 6), backend="reference")])
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    # Causal: changing a later token of sequence 0 leaves earlier outputs alone.
    k2 = k.detach().clone()
    k2[3] += 1.0
    torch.testing.assert_close(attend(q, k2, v, (0, 4, 10), backend="sdpa")[:3], packed[:3])


def test_backend_selection_and_errors():
    q, k, v = _qkv(4, 2, 2)
    assert resolve_backend("auto", q) == "sdpa"   # float64 on CPU never picks flash
    with pytest.raises(ValueError, match="unknown attention backend 'tiled'"):
        attend(q, k, v, (0, 4), backend="tiled")
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to at most 4 tokens"):
        attend(q, k, v, (0, 5), backend="sdpa")
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        attend(*_qkv(4, 3, 2), (0, 4))
    if not flash_available():
        with pytest.raises(ValueError, match="'flash' needs flash_attn installed and CUDA"):
            attend(q, k, v, (0, 4), backend="flash")


@pytest.mark.skipif(not flash_available(), reason="flash-attn path needs CUDA and the flash_attn package")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1)])
def test_flash_matches_reference(heads, kv_heads):
    q, k, v = _qkv(37, heads, kv_heads, dim=64, dtype=torch.bfloat16, device="cuda")
    cu = (0, 20, 21, 35)
    out_f, grads_f = _run("flash", q, k, v, cu)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_r, grads_r = _run("reference", q64, k64, v64, cu)
    torch.testing.assert_close(out_f.double(), out_r, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_f, grads_r):
        torch.testing.assert_close(a.double(), b, rtol=5e-2, atol=5e-2)
