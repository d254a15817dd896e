"""The LM-head loss dispatch (``fused_loss.lm_head_loss``): a stand-in ``liger_kernel`` module with the
library's functional API shape (it records its calls and computes ``F.linear`` + ``F.cross_entropy``) is picked
when importable and on an allowed device, gets one dtype, SUM reduction, ``IGNORE_INDEX`` and fp32
accumulation, and its loss and gradients (in each input's dtype) match the project's own loss; every case the
library cannot serve falls back to the own loss."""
import sys
import types

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import flexsp.runtime.models.fused_loss as fused  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.fused_loss import choose_kernel, lm_head_loss  # noqa: E402
from flexsp.runtime.models.loss import linear_cross_entropy  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.sp.context import IGNORE_INDEX, AttentionContext  # noqa: E402


def _standin(calls):
    """``liger_kernel.transformers.functional`` with the library's signature, computing the reference."""
    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                         return_token_accuracy=False):
        calls.append({"dtypes": {t.dtype for t in (input, weight, bias) if t is not None}, "ignore_index": ignore_index,
                      "reduction": reduction, "accum_dtype": accum_dtype, "autocast": torch.is_autocast_enabled("cpu"),
                      "bias": bias is not None})
        logits = F.linear(input, weight, bias).float()
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.functional = functional
    root = types.ModuleType("liger_kernel")
    root.transformers = transformers
    return {"liger_kernel": root, "liger_kernel.transformers": transformers,
            "liger_kernel.transformers.functional": functional}


@pytest.fixture
def library(monkeypatch):
    """The stand-in importable and CPU counted as a device the library runs on; yields its calls."""
    calls = []
    for name, module in _standin(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fused, "LIBRARY_DEVICES", frozenset({"cuda", "cpu"}))
    return calls


def _inputs(tokens=40, hidden=16, vocab=50, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.3).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if bias else None
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::3] = IGNORE_INDEX
    return h, w, b, y


def _loss_and_grads(fn, h, w, b, y, autocast):
    leaves = [t for t in (h, w, b) if t is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, b, y)
    return loss, torch.autograd.grad(loss * 0.5, leaves)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_library_is_picked_and_matches_the_own_loss(library, autocast, bias):
    h, w, b, y = _inputs(bias=bias)
    got, got_grads = _loss_and_grads(lm_head_loss, h, w, b, y, autocast)
    want, want_grads = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_tokens=7), h, w, b, y, autocast)
    assert len(library) == 1
    call = library[0]
    assert call["dtypes"] == {torch.bfloat16 if autocast else torch.float32}   # one dtype in: autocast's
    assert (call["ignore_index"], call["reduction"], call["accum_dtype"]) == (IGNORE_INDEX, "sum", torch.float32)
    assert not call["autocast"] and call["bias"] == bias
    assert got.dtype == torch.float32
    tol = 2e-2 if autocast else 1e-5
    assert abs(got.item() - want.item()) <= tol * abs(want.item())
    for a, e in zip(got_grads, want_grads):
        assert a.dtype == e.dtype == torch.float32                          # fp32 masters get fp32 gradients
        assert float((a - e).abs().max()) <= tol * float(e.abs().max())


@pytest.mark.parametrize("tied", [True, False])
def test_tinylm_goes_through_the_library_and_matches_its_own_loss(library, tied):
    spec = ModelSpec(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, tie_embeddings=tied)
    torch.manual_seed(0)
    fused_model = TinyLM(spec)
    own = TinyLM(spec, loss_kernel="flexsp")
    own.load_state_dict(fused_model.state_dict())
    ids = torch.randint(0, 64, (30,))
    labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    results = []
    for model in (fused_model, own):
        loss = model.shard_loss(ids, torch.arange(30), labels, AttentionContext.single(30))
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    assert len(library) == 1                                          # the fused model only
    assert abs(results[0][0].item() - results[1][0].item()) <= 1e-5 * results[1][0].item()
    for a, e in zip(results[0][1], results[1][1]):                    # tied: head and embedding add in one weight
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_hf_adapter_goes_through_the_library(library):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from flexsp.hf import prepare_model, tiny_config
    torch.manual_seed(0)
    native = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                                          num_hidden_layers=1))
    ids = torch.randint(1, 64, (20,))
    labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    losses = []
    for kernel in (None, "flexsp"):
        sp = prepare_model(native, loss_kernel=kernel, probe=False)
        losses.append(sp.shard_loss(ids, torch.arange(20), labels, AttentionContext.single(20)))
    assert len(library) == 1
    assert abs(losses[0].item() - losses[1].item()) <= 1e-5 * losses[1].item()


def _fallback(library, expect_reason, h, w, b, y, **kw):
    """The own loss served the call (the stand-in saw nothing) and gave the reference's answer."""
    assert choose_kernel(h, w, b, kw.get("kernel"))[0] == "flexsp"
    assert expect_reason in (choose_kernel(h, w, b, kw.get("kernel"))[1] or "")
    got = lm_head_loss(h, w, b, y, **kw)
    want = F.cross_entropy(F.linear(h.detach(), w.detach(), None if b is None else b.detach()), y,
                           ignore_index=IGNORE_INDEX, reduction="sum")
    assert library == []
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))


def test_device_the_library_does_not_run_on_falls_back(library, monkeypatch):
    monkeypatch.setattr(fused, "LIBRARY_DEVICES", frozenset({"cuda"}))
    _fallback(library, "device cpu", *_inputs())


def test_library_not_installed_falls_back(library, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)   # import raises ImportError
    _fallback(library, "does not import", *_inputs())


def test_fp64_falls_back(library):
    _fallback(library, "matmul dtype torch.float64", *_inputs(dtype=torch.float64))


def test_no_grad_and_frozen_hidden_fall_back(library):
    h, w, b, y = _inputs()
    with torch.no_grad():
        _fallback(library, "no gradient", h, w, b, y)
    h.requires_grad_(False)                       # a head gradient without the hidden states'
    _fallback(library, "not the hidden states", h, w, b, y)


def test_empty_shard_and_asked_for_own_loss_fall_back(library):
    h, w, b, y = _inputs(tokens=0)
    _fallback(library, "empty shard", h, w, b, y)
    _fallback(library, "asked for", *_inputs(), kernel="flexsp")


def test_kernel_names_are_checked(library):
    h, w, b, y = _inputs(dtype=torch.float64)
    with pytest.raises(ValueError, match="'liger' cannot serve this call: matmul dtype"):
        lm_head_loss(h, w, b, y, kernel="liger")
    with pytest.raises(ValueError, match="loss kernel 'triton' is not one of"):
        lm_head_loss(h, w, b, y, kernel="triton")


@pytest.mark.parametrize("scale,softcap", [(0.25, None), (1.0, 2.0), (3.0, 1.5)])
def test_logit_scale_and_final_softcap_are_exact_through_the_chunked_loss(scale, softcap):
    """Granite's logits_scaling and Gemma 2's final_logit_softcapping: the own loss, chunk by chunk, equals
    cross-entropy of the transformed full logits, gradients included; 'auto' does not hand them to the library."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(13, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (13,), generator=g)
    labels[[2, 7]] = IGNORE_INDEX
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    got = lm_head_loss(*leaves, labels, chunk_tokens=4, logit_scale=scale, softcap=softcap)
    grads = torch.autograd.grad(got, leaves)
    ref = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    z = F.linear(*ref) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    want = F.cross_entropy(z, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    wgrads = torch.autograd.grad(want, ref)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    plain = lm_head_loss(hidden, weight, bias, labels, chunk_tokens=4)
    assert not torch.isclose(plain, got)
    with pytest.raises(ValueError, match="scales or soft-caps its logits"):
        lm_head_loss(hidden, weight, bias, labels, kernel="liger", logit_scale=scale, softcap=softcap)
