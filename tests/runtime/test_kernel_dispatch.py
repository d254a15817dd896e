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
    # what the installed torch offers, read from it (torch 2.11: no enable_gqa; 2.13: enable_gqa; neither selects)
    assert api.gqa == ("enable_gqa" in inspect.signature(varlen.varlen_attn).parameters)
    assert api.selects == (hasattr(varlen, "_select_backend") or "backend" in api.backward_args)


# --- the rule on faked devices ------------------------------------------------------------------------
from flexsp.runtime.kernels.rule import (FEW_SEQUENCES, LONG_MEAN, DeviceFacts,  # noqa: E402
                                         LengthMix, choose, lse_kernel)

BF16, FP32 = torch.bfloat16, torch.float32
H200 = DeviceFacts("cuda", (9, 0), (2, 11), varlen=True)                 # the measured machine
H100_FA3 = DeviceFacts("cuda", (9, 0), (2, 11), varlen=True, flash=3)
H100_NEW_TORCH = DeviceFacts("cuda", (9, 0), (2, 14), varlen=True, varlen_selects=True, cudnn=91900)
H100_OLD_CUDNN = DeviceFacts("cuda", (9, 0), (2, 14), varlen=True, varlen_selects=True, cudnn=91000)
H100_NO_HOOK = DeviceFacts("cuda", (9, 0), (2, 15), varlen=True, cudnn=91900)     # a newer torch, no selection
IDLE_MIX = LengthMix.of((0, 1))                                                   # the executor's idle dummy
SHORT_128 = LengthMix.of(tuple(range(0, 8 * 128 + 1, 128)))                       # longest exactly 128
A100 = DeviceFacts("cuda", (8, 0), (2, 11), varlen=True)
A100_FA2_OLD_TORCH = DeviceFacts("cuda", (8, 0), (2, 9), varlen=False, flash=2)
HOPPER_NO_KERNELS = DeviceFacts("cuda", (9, 0), (2, 9))
CPU = DeviceFacts("cpu", None, (2, 13))
MEASURED_MIX = LengthMix.of((0, 16384, 24576, 28672, 30720, 31744, 32768, 33280, 33792))   # 33,792 tokens
SHORT_MIX = LengthMix.of(tuple(range(0, 64 * 512 + 1, 512)))                               # 64 x 512
EIGHT_4K = LengthMix.of(tuple(range(0, 8 * 4096 + 1, 4096)))


@pytest.mark.parametrize("facts,dtype,dim,mix,want", [
    # the two measured shapes on the H200: per-sequence SDPA (cuDNN) for few long, one varlen launch for many short
    (H200, BF16, 128, MEASURED_MIX, "sdpa"),
    (H200, BF16, 128, SHORT_MIX, "varlen"),
    (H200, BF16, 128, EIGHT_4K, "sdpa"),
    (H200, BF16, 128, None, "varlen"),            # lengths unknown (device bounds only): one launch, no host read
    (H200, BF16, 256, MEASURED_MIX, "varlen"),    # head dim past cuDNN's fast path
    (H200, BF16, 64, MEASURED_MIX, "sdpa"),
    (H200, FP32, 128, SHORT_MIX, "sdpa"),         # no fp32 varlen kernel
    (H200, BF16, 320, SHORT_MIX, "sdpa"),         # past FlashAttention's head dims
    (H200, BF16, 100, SHORT_MIX, "sdpa"),         # not a multiple of 8
    # FlashAttention-3 on Hopper: one launch for every mix
    (H100_FA3, BF16, 128, MEASURED_MIX, "flash"),
    (H100_FA3, BF16, 128, SHORT_MIX, "flash"),
    # a torch whose varlen honours sdpa_kernel(CUDNN): cuDNN in one launch, up to head dim 128
    (H100_NEW_TORCH, BF16, 128, SHORT_MIX, "varlen_cudnn"),
    (H100_NEW_TORCH, BF16, 128, MEASURED_MIX, "varlen_cudnn"),
    (H100_NEW_TORCH, BF16, 256, MEASURED_MIX, "varlen"),
    (H100_NEW_TORCH, BF16, 128, IDLE_MIX, "varlen"),        # cuDNN takes max_q > 128 only
    (H100_NEW_TORCH, BF16, 128, SHORT_128, "varlen"),
    (H100_NEW_TORCH, BF16, 128, None, "varlen"),            # lengths unknown: cannot check max_q
    (H100_OLD_CUDNN, BF16, 128, SHORT_MIX, "varlen"),       # cuDNN < 9.18
    (H100_NO_HOOK, BF16, 128, SHORT_MIX, "varlen"),         # the version alone decides nothing
    # Ampere: SDPA per sequence would run the same FA2 kernel in more launches
    (A100, BF16, 128, MEASURED_MIX, "varlen"),
    (A100, BF16, 64, SHORT_MIX, "varlen"),
    (A100_FA2_OLD_TORCH, BF16, 128, SHORT_MIX, "flash"),
    (A100_FA2_OLD_TORCH, BF16, 128, MEASURED_MIX, "flash"),
    (HOPPER_NO_KERNELS, BF16, 128, SHORT_MIX, "sdpa"),
    (CPU, BF16, 64, SHORT_MIX, "sdpa"),
    (CPU, FP32, 64, None, "sdpa"),
])
def test_rule_on_faked_devices(facts, dtype, dim, mix, want):
    assert choose(facts, dtype, dim, mix) == want


def test_length_mix_thresholds():
    assert (MEASURED_MIX.sequences, MEASURED_MIX.tokens, MEASURED_MIX.longest) == (8, 33792, 16384)
    assert MEASURED_MIX.few_long and EIGHT_4K.few_long and not SHORT_MIX.few_long
    many_long = LengthMix.of(tuple(range(0, (FEW_SEQUENCES + 1) * LONG_MEAN + 1, LONG_MEAN)))
    assert not many_long.few_long                           # too many launches
    assert not LengthMix.of((0, LONG_MEAN - 1)).few_long    # one short sequence
    assert LengthMix.of((0, 0, 5, 5)) == LengthMix(1, 5, 5) and not LengthMix.of((0, 0)).few_long   # empties skipped


def test_resolve_backend_reads_the_length_mix_from_host_bounds_and_checks_overrides():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(33792, 4, 128, dtype=BF16, device="cuda")
        q32 = torch.empty(8, 4, 128, dtype=FP32, device="cuda")
    bounds = (0, 16384, 24576, 28672, 30720, 31744, 32768, 33280, 33792)
    assert resolve_backend("auto", q, bounds, facts=H200) == "sdpa"
    assert resolve_backend("auto", q, None, facts=H200) == "varlen"
    assert resolve_backend("varlen", q, bounds, facts=H200) == "varlen"          # backend= overrides the rule
    assert resolve_backend("sdpa_each", q, bounds, facts=H200) == "sdpa_each"
    with pytest.raises(kernels.AttentionError, match="'varlen_cudnn' needs a varlen_attn that selects its backend"):
        resolve_backend("varlen_cudnn", q, bounds, facts=H200)
    with pytest.raises(kernels.AttentionError, match=r"cuDNN >= 9.18 \(this is 91000\)"):
        resolve_backend("varlen_cudnn", q, bounds, facts=H100_OLD_CUDNN)
    with pytest.raises(kernels.AttentionError, match="'flash' needs flash_attn installed"):
        resolve_backend("flash", q, bounds, facts=H200)
    with pytest.raises(kernels.AttentionError, match="'varlen' needs CUDA tensors in float16/bfloat16"):
        resolve_backend("varlen", q32, None, facts=H200)
    # the ring's lse form follows the rule where a kernel has one: the per-sequence choice and flash go through varlen
    assert lse_kernel("auto", q, bounds, facts=H200) == "varlen"
    assert lse_kernel("auto", q, bounds, facts=H100_FA3) == "varlen"
    assert lse_kernel("auto", q, bounds, facts=H100_NEW_TORCH) == "varlen_cudnn"
    assert lse_kernel("sdpa", q, bounds, facts=H200) == "sdpa"                   # an explicit choice stays
    assert lse_kernel("auto", q, bounds, facts=A100_FA2_OLD_TORCH) == "sdpa"     # no varlen: per sequence
    assert lse_kernel("auto", q32, None, facts=H200) == "sdpa"


def test_device_facts_of_this_machine(monkeypatch):
    from flexsp.runtime.kernels import rule
    cpu = rule.device_facts("cpu")
    assert (cpu.device_type, cpu.capability, cpu.varlen, cpu.flash) == ("cpu", None, False, 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.empty(2, device="cuda")
    facts = rule.device_facts(fake.device)            # fake CUDA on a CPU build: no capability to read
    assert facts.varlen == (kernels.VARLEN is not None) and facts.capability is None
    assert facts.torch_version == rule._version(torch.__version__) and rule._version("2.14.0a0+git1") == (2, 14)
    assert facts.varlen_selects == (kernels.VARLEN is not None and kernels.VARLEN.selects)
    monkeypatch.setattr(flash_mod, "FLASH", flash_mod.FlashAPI(object(), 3))
    assert rule.device_facts(fake.device).flash == 3 and rule.device_facts("cpu").flash == 0
