"""The CUDA path checked without a GPU: fake CUDA bf16 tensors (``FakeTensorMode``) run torch's
``varlen_attn`` fake kernels through ``auto``'s CUDA choice - the kernels' forward and backward, the
Ulysses branch (degree 2, a local exchange), the ring branch (forward and its hand-written backward)
TinyLM's degree-1 forward and the fused LM-head loss (forward, which computes its gradients, and backward) -
verifying shapes, dtypes and the arguments ``varlen_attn`` receives.

Limits of a CPU-only torch build, stated so nobody reads more into this check: autograd's engine and
any real copy (``.contiguous()`` of a strided tensor, ``.to("cuda")``, ``copy_``) need a CUDA device guard,
which a CPU-only build has none of: torch 2.13's ``FakeTensorMode`` installs a no-op CUDA guard only on a
CUDA build without devices (``ensureCUDADeviceGuardSet``), and a ``requires_grad`` fake CUDA leaf in an op
aborts the process (AccumulateGrad asks the missing guard for a stream). So backward passes are called
explicitly (the ring's, the kernels', the loss's), not through ``loss.backward()``.
"""
import types

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import flexsp.runtime.kernels as kernels  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.kernels import LseSpec, attend, attend_lse, lse_backward  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.sp import ring as ring_mod  # noqa: E402
from flexsp.runtime.sp.context import AttentionContext  # noqa: E402
from flexsp.runtime.sp.ulysses import ulysses_attention  # noqa: E402
from flexsp.runtime.sp.zigzag import RingTensors, zigzag_layout  # noqa: E402
from flexsp.runtime.kernels import varlen as varlen_mod  # noqa: E402
from flexsp.runtime.kernels.varlen import VarlenAPI  # noqa: E402

pytestmark = pytest.mark.skipif(kernels.VARLEN is None, reason="this torch has no varlen_attn signature we know")
BF16 = torch.bfloat16


@pytest.fixture
def calls(monkeypatch):
    """Every ``varlen_attn`` call's keyword arguments (the real function runs: its fake kernel)."""
    seen = []
    real = kernels.VARLEN

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real.fn(*args, **kwargs)
    recording.__signature__ = __import__("inspect").signature(real.fn)
    api = VarlenAPI.detect(recording, real.aux, real.backward_op)
    monkeypatch.setattr(varlen_mod, "VARLEN", api)
    return seen


def fake_out_dtype_addmm() -> bool:
    """Whether this torch's fake kernels run ``addmm(out_dtype=fp32, out=)`` on bf16 inputs."""
    try:
        with FakeTensorMode():
            acc, a = torch.zeros(2, 2), torch.ones(2, 2, dtype=BF16)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _fake(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def test_kernels_forward_and_backward_on_fake_cuda(calls):
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake(64, 4, 64), _fake(64, 2, 64), _fake(64, 2, 64)
        cu = torch.tensor([0, 30, 60], dtype=torch.int32, device="cuda")
        assert kernels.resolve_backend("auto", q) == "varlen"
        out = attend(q, k, v, cu, max_seqlen=30)
        assert (out.shape, out.dtype, out.device.type) == ((64, 4, 64), BF16, "cuda")
        o, lse = attend_lse(q, k, v, cu, cu, max_seqlen_q=30, max_seqlen_k=30, causal=False)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((64, 4, 64), BF16, (4, 64), torch.float32)
        spec = LseSpec(cu, cu, 30, 30, True, 0.125, "varlen")
        dq, dk, dv = lse_backward(torch.randn_like(o), q, k, v, o, lse, spec)
        assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
        assert {t.dtype for t in (dq, dk, dv)} == {BF16}
    assert calls == [_expected(causal=True), _expected(causal=False, return_aux=kernels.VARLEN.aux(lse=True))]


def _expected(causal: bool, **extra) -> dict:
    """The keyword arguments the installed ``varlen_attn`` is called with: what its signature offers (torch 2.11:
    window_size and scale, kv heads repeated; 2.12+: enable_gqa for the 4-on-2 heads here)."""
    api = kernels.VARLEN
    kwargs = ({"window_size": (-1, 0) if causal else (-1, -1)} if api.causal_arg == "window_size"
              else {"is_causal": causal})
    if api.scale:
        kwargs["scale"] = 0.125
    if api.gqa:
        kwargs["enable_gqa"] = True
    return {**kwargs, **extra}


class _Exchange:
    """Degree-2 Ulysses stand-in with the real exchange's shapes (function-form ops only)."""
    degree = 2

    def seq_to_head(self, x):
        return x.narrow(1, 0, x.shape[1] // 2).repeat(2, 1, 1)

    def head_to_seq(self, x):
        return x.narrow(0, 0, x.shape[0] // 2).repeat(1, 2, 1)


def test_ulysses_branch_and_degree_one_model_forward_on_fake_cuda(calls):
    model = TinyLM(ModelSpec(vocab=128, hidden=256, layers=2, heads=4, kv_heads=2, ffn=512))
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake(32, 4, 64), _fake(32, 2, 64), _fake(32, 2, 64)
        cu = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
        ctx = AttentionContext(cu_seqlens=cu, max_seqlen=40, exchange=_Exchange(), bounds=(0, 40, 64))
        out = ulysses_attention(q, k, v, ctx)
        assert (out.shape, out.dtype) == ((32, 4, 64), BF16)
        # fake CUDA parameters in the model's places (a fake tensor cannot be copied or initialised on CUDA here)
        params = {name: _fake(*p.shape) for name, p in model.named_parameters()}
        ids = torch.randint(1, 128, (64,), device="cuda")
        pos = torch.randint(0, 40, (64,), device="cuda")
        one = AttentionContext(cu_seqlens=cu, max_seqlen=40, bounds=(0, 40, 64))
        logits = torch.func.functional_call(model, params, (ids, pos, one))
        assert (logits.shape, logits.dtype) == ((64, 128), BF16)
    # degree 2: 2 q heads on 1 kv head per rank; the model: 4 on 2 (kv repeated where there is no enable_gqa)
    assert all(c.get("enable_gqa", False) == kernels.VARLEN.gqa for c in calls)
    causal = ("window_size", (-1, 0)) if kernels.VARLEN.causal_arg == "window_size" else ("is_causal", True)
    assert all(c[causal[0]] == causal[1] for c in calls) and len(calls) == 1 + 2   # Ulysses, then 2 layers


class _Ring:
    """A ring of one neighbour that hands back what it is sent (shapes only)."""

    def __init__(self, size):
        self.size = size

    def hop(self, tensor, tag=0):
        return types.SimpleNamespace(wait=lambda: tensor)


def test_ring_branch_forward_and_backward_on_fake_cuda(calls):
    lay = zigzag_layout([48, 16], 1, 2)
    # the ring's index tensors are host-built and pinned where CUDA is real (a fake tensor cannot be pinned):
    # real CUDA tensors there, fake ones on a CPU-only build
    rt = RingTensors.build(lay, 1, "cuda") if torch.cuda.is_available() else None
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        rt = rt if rt is not None else RingTensors.build(lay, 1, "cuda")
        q, k, v = _fake(lay.shard_tokens, 4, 64), _fake(lay.shard_tokens, 2, 64), _fake(lay.shard_tokens, 2, 64)
        ctx = types.SimpleNamespace()
        ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
        out = ring_mod._RingAttention.forward(ctx, q, k, v, rt, _Ring(2), "varlen", 0.125)
        assert (out.shape, out.dtype) == (q.shape, BF16)
        assert ctx.saved_tensors[4].shape == (4, lay.shard_tokens) and ctx.saved_tensors[4].dtype == torch.float32
        dq, dk, dv, *rest = ring_mod._RingAttention.backward(ctx, torch.randn_like(out))
        assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape] and {t.dtype for t in (dq, dk, dv)} == {BF16}
    key = "window_size" if kernels.VARLEN.causal_arg == "window_size" else "is_causal"
    assert len({c[key] for c in calls}) == 2                          # the diagonal causal, the other block not
    assert all("return_aux" in c for c in calls)


def test_fused_loss_forward_and_backward_on_fake_cuda(monkeypatch):
    """The LM-head loss on bf16 CUDA: each chunk's gradients computed in forward (fp32 softmax, bf16 matmuls).
    The weight gradient's out_dtype matmul is taken where this torch's fake kernels run it (torch 2.11's
    decomposition of ``addmm(out_dtype=)`` under FakeTensorMode does not)."""
    from flexsp.runtime.models import loss as loss_mod
    from flexsp.runtime.models.loss import _LinearCrossEntropy
    monkeypatch.setattr(loss_mod, "has_out_dtype_matmul",   # (a CPU-only build cannot write a fake CUDA out=)
                        lambda device: torch.cuda.is_available() and fake_out_dtype_addmm())
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        hidden, weight = _fake(70, 256), _fake(128, 256)
        labels = torch.randint(0, 128, (70,), device="cuda")
        ctx = types.SimpleNamespace(needs_input_grad=(True, True, False, False, False, False, False))
        ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
        total = _LinearCrossEntropy.forward(ctx, hidden, weight, None, labels, 32, BF16, True)
        assert (total.shape, total.dtype, total.device.type) == ((), torch.float32, "cuda")
        grad_h, grad_w = ctx.saved_tensors
        assert (grad_h.shape, grad_h.dtype, grad_w.shape, grad_w.dtype) == ((70, 256), BF16, (128, 256), torch.float32)
        dh, dw, db, *rest = _LinearCrossEntropy.backward(ctx, torch.ones((), device="cuda"))
        assert (dh.dtype, dw.dtype, db) == (BF16, BF16, None) and all(r is None for r in rest)
