"""The fused LM-head loss (``linear_cross_entropy``) against unchunked ``F.linear`` + ``F.cross_entropy``:
equal loss and gradients in fp64 for every chunking, ignored targets, tied / frozen weights, autocast;
no op ever produces a ``[tokens, vocab]`` tensor, and backward recomputes nothing."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.loss import linear_cross_entropy  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.sp.context import IGNORE_INDEX  # noqa: E402


def _inputs(tokens=23, hidden=16, vocab=37, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::4] = IGNORE_INDEX
    y[-1] = IGNORE_INDEX
    return h, w, b, y


def _grads(loss, tensors, scale):
    return torch.autograd.grad(loss * scale, tensors)


@pytest.mark.parametrize("chunk", [1, 5, 7, 22, 23, 64, None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_unchunked_cross_entropy_in_fp64(chunk, with_bias):
    h, w, b, y = _inputs()
    b = b if with_bias else None
    leaves = [t for t in (h, w, b) if t is not None]
    got = linear_cross_entropy(h, w, b, y, chunk)
    want = F.cross_entropy(F.linear(h, w, b), y, ignore_index=IGNORE_INDEX, reduction="sum")
    assert got.dtype == torch.float64
    assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
    for a, e in zip(_grads(got, leaves, 0.37), _grads(want, leaves, 0.37)):   # backward scales by grad_output
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    h, w, b, y = _inputs()
    y[:] = IGNORE_INDEX
    got = linear_cross_entropy(h, w, b, y, 5)
    assert got.item() == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in _grads(got, (h, w, b), 1.0))


def test_frozen_head_and_no_grad():
    h, w, b, y = _inputs()
    w.requires_grad_(False)
    b.requires_grad_(False)
    got = linear_cross_entropy(h, w, b, y, 6)
    want = F.cross_entropy(F.linear(h, w, b), y, reduction="sum")
    (gh,) = torch.autograd.grad(got, h)
    torch.testing.assert_close(gh, torch.autograd.grad(want, h)[0], rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        quiet = linear_cross_entropy(h, w, b, y, 6)
    assert not quiet.requires_grad and abs(quiet.item() - want.item()) <= 1e-10 * want.item()


@pytest.mark.parametrize("tied", [True, False])
def test_tinylm_loss_and_gradients_equal_the_unfused_model(tied):
    spec = ModelSpec(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, tie_embeddings=tied)
    torch.manual_seed(1)
    model = TinyLM(spec, loss_chunk_tokens=9).double()
    ids = torch.randint(0, 50, (30,))
    labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    from flexsp.runtime.sp.context import AttentionContext
    ctx = AttentionContext.single(30)
    got = model.shard_loss(ids, torch.arange(30), labels, ctx)
    mine = torch.autograd.grad(got, list(model.parameters()))
    want = F.cross_entropy(model(ids, torch.arange(30), ctx), labels, reduction="sum")
    ref = torch.autograd.grad(want, list(model.parameters()))
    assert abs(got.item() - want.item()) <= 1e-10 * want.item()
    for a, e in zip(mine, ref):   # tied: the head's gradient and the embedding's add up in one weight
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_autocast_bf16_matches_autocast_reference_and_keeps_fp32_gradients():
    h, w, b, y = _inputs(dtype=torch.float32, tokens=64, vocab=100, hidden=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, b, y, 10)
        want = F.cross_entropy(F.linear(h, w, b).float(), y, reduction="sum")
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-2 * want.item()
    for a, e in zip(_grads(got, (h, w, b), 1.0), _grads(want, (h, w, b), 1.0)):
        assert a.dtype == torch.float32
        assert float((a - e).abs().max()) <= 2e-2 * float(e.abs().max())


class _Largest(TorchDispatchMode):
    """The element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_holds_tokens_by_vocab_and_backward_recomputes_nothing():
    tokens, hidden, vocab, chunk = 4096, 8, 512, 256
    h, w, b, y = _inputs(tokens, hidden, vocab, dtype=torch.float32)
    seen = _Largest()
    with seen:
        loss = linear_cross_entropy(h, w, b, y, chunk)
    assert seen.largest == chunk * vocab            # one chunk's logits at a time, never tokens x vocab
    backward = _Largest()
    with backward:
        loss.backward()
    assert backward.largest == tokens * hidden      # scaling the kept [tokens, hidden] gradient: no logits
    want = F.cross_entropy(F.linear(h.detach(), w.detach(), b.detach()), y, reduction="sum")
    assert abs(loss.item() - want.item()) <= 1e-5 * want.item()


def test_empty_shard():
    h, w = torch.zeros(0, 8, requires_grad=True), torch.ones(5, 8, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = linear_cross_entropy(h, w, None, torch.zeros(0, dtype=torch.long), 4)
        gh, gw = torch.autograd.grad(got, (h, w))
        assert got.item() == 0.0 and gh.shape == (0, 8) and float(gw.abs().max()) == 0.0


class _WeightShaped(TorchDispatchMode):
    """Counts the new tensors of one shape that ops produce (a view, an in-place or ``out=`` result aliases an
    input: the schema says so), and the chunks (one ``amax`` per chunk's logits)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.new, self.chunks = tuple(shape), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, ret in zip(outs, func._schema.returns):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape and ret.alias_info is None:
                self.new += 1
        self.chunks += func is torch.ops.aten.amax.default
        return out


@pytest.mark.parametrize("path", ["autocast bf16, blocked (CPU)", "autocast bf16, out_dtype (CUDA)", "fp32"])
def test_no_weight_shaped_temporary_per_chunk_at_llama3_vocab(path, monkeypatch):
    """Vocabulary 128,256 and 16,384 tokens (fake tensors: shapes only; the hidden size is small, it does not
    change the chunk count): the weight gradient is accumulated in place, so forward makes the accumulator and
    (under autocast) the weight's bf16 copy, backward one scaled gradient - however many chunks there are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flexsp.runtime.models.loss as loss_mod
    if "out_dtype" in path:   # CUDA's branch on fake CPU tensors (their meta kernel has out_dtype)
        from .test_cuda_fake import fake_out_dtype_addmm
        if not fake_out_dtype_addmm():
            pytest.skip("this torch's fake addmm(out_dtype=) fails (torch 2.11's decomposition): shapes unknowable")
        monkeypatch.setattr(loss_mod, "has_out_dtype_matmul", lambda device: True)
    tokens, hidden, vocab = 16384, 8, 128256
    with FakeTensorMode():
        h = torch.randn(tokens, hidden, requires_grad=True)
        w = torch.randn(vocab, hidden, requires_grad=True)
        y = torch.randint(0, vocab, (tokens,))
        seen = _WeightShaped(w.shape)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in path), seen:
            loss = linear_cross_entropy(h, w, None, y)
        forward = seen.new
        with seen:
            loss.backward()
        assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    assert seen.chunks >= 8                                   # the budget's chunks at this vocabulary
    assert forward <= (2 if "autocast" in path else 1)        # accumulator (+ the weight's bf16 copy)
    assert seen.new - forward <= 1                            # backward: the kept gradient times grad_output


def test_chunk_follows_free_device_memory_up_to_a_cap(monkeypatch):
    """On CUDA the chunk is a fraction of free memory (driver-free plus the allocator's unused cache); on CPU,
    or where the driver does not answer, a documented cap."""
    import flexsp.runtime.models.loss as loss_mod
    free = {"bytes": 8 * 2**30}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * 2**30)
    vocab, bf16 = 128256, torch.bfloat16
    small = loss_mod.default_chunk(vocab, "cuda", bf16)
    free["bytes"] = 17 * 2**30
    assert loss_mod.default_chunk(vocab, "cuda", bf16) in (2 * small, 2 * small + 1)   # (8 + 1) GiB -> (17 + 1) GiB
    assert small * loss_mod.bytes_per_logit(bf16) * vocab <= 9 * 2**30 * loss_mod.CUDA_FREE_FRACTION
    free["bytes"] = 10**15
    assert loss_mod.default_chunk(vocab, "cuda", bf16) * loss_mod.bytes_per_logit(bf16) * vocab <= loss_mod.CUDA_CHUNK_BYTES
    host = loss_mod.default_chunk(vocab, "cpu", bf16)
    assert host == loss_mod.HOST_CHUNK_BYTES // (loss_mod.bytes_per_logit(bf16) * vocab)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (_ for _ in ()).throw(RuntimeError("no driver")))
    assert loss_mod.default_chunk(vocab, "cuda", bf16) == host
    assert loss_mod.default_chunk(vocab, "cpu", torch.float32) in (2 * host, 2 * host + 1)   # fp32: no bf16 copies


@pytest.mark.parametrize("vocab", [37, 20])   # 37 rows: 8 blocks of 5 and a short one
def test_blocked_weight_gradient_accumulation_equals_one_matmul(vocab):
    """The CPU branch for bf16 matmuls into an fp32 accumulator sums the same bf16 products block by block."""
    from flexsp.runtime.models.loss import accumulate_outer
    gen = torch.Generator().manual_seed(3)
    g, h = (torch.randn(11, vocab, generator=gen).bfloat16(), torch.randn(11, 6, generator=gen).bfloat16())
    acc = torch.randn(vocab, 6, generator=gen)
    want = acc + (g.t().float() @ h.float())
    accumulate_outer(acc, g, h)
    torch.testing.assert_close(acc, want, rtol=1e-2, atol=1e-2)
