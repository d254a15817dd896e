"""The reference model: packed sequences stay independent; tied and untied heads; config checks."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from flexsp.plan.specs import ModelSpec
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.shard import pack  # noqa: E402
from flexsp.runtime.sp.context import ShardingError  # noqa: E402

CFG = ModelSpec(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)


@pytest.mark.parametrize("tie", [True, False])
def test_packed_forward_equals_separate_forwards(tie):
    torch.manual_seed(0)
    model = TinyLM(ModelSpec(**{**CFG.__dict__, "tie_embeddings": tie})).double()
    seqs = [torch.randint(1, 64, (n,)) for n in (7, 1, 5)]
    p = pack(seqs, degree=1)
    ctx = p.context(backend="sdpa")   # device int32 cu_seqlens, host max_seqlen
    assert ctx.cu_seqlens.dtype == torch.int32 and ctx.cu_seqlens.tolist() == list(p.cu_seqlens)
    assert ctx.max_seqlen == 7
    packed = model(p.input_ids, p.position_ids, ctx)
    alone = torch.cat([model(s) for s in seqs])   # each from position 0, attending to itself only
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)
    assert packed.shape == (13, 64)


def test_tied_head_shares_the_embedding():
    tied, untied = TinyLM(CFG), TinyLM(ModelSpec(**{**CFG.__dict__, "tie_embeddings": False}))
    assert tied.lm_head is None
    extra = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert extra == CFG.vocab * CFG.hidden


def test_spec_errors_name_the_value():
    with pytest.raises(ValueError, match=r"hidden \(30\) is not divisible by heads \(4\)"):
        dataclasses.replace(CFG, hidden=30)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        dataclasses.replace(CFG, kv_heads=3)
    with pytest.raises(ValueError, match="head size 3 must be even for rotary embeddings"):
        TinyLM(dataclasses.replace(CFG, hidden=12))


def test_no_host_sync_in_forward_or_backward(monkeypatch):
    """The model, Ulysses layer, attention kernel, packing context and chunked loss read nothing back to
    the host: the per-sequence kernel takes the context's host bounds, never the device tensor's."""
    torch.manual_seed(0)
    model = TinyLM(CFG, loss_chunk_tokens=4).double()   # several fused loss chunks
    p = pack([torch.randint(1, 64, (n,)) for n in (7, 1, 5)], degree=1)
    ctx = p.context()                                     # the one host-to-device copy, before the step
    ctx = dataclasses.replace(ctx, cu_seqlens=ctx.cu_seqlens.to("meta"))   # the kernel must not even look

    def sync(*args, **kwargs):
        raise AssertionError("host sync inside forward/backward")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    loss = model.shard_loss(p.input_ids, p.position_ids, p.labels, ctx)
    loss.backward()
    monkeypatch.undo()
    want = sum(torch.nn.functional.cross_entropy(model(s.view(-1))[:-1], s.view(-1)[1:], reduction="sum")
               for s in torch.split(p.input_ids[:13], [7, 1, 5]))
    assert abs(loss.item() - want.item()) < 1e-10
