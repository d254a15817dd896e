"""The reference model: packed sequences stay independent; tied and untied heads; config checks."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.model import ModelConfig, TinyLM  # noqa: E402
from flexsp.runtime.packing import pack  # noqa: E402
from flexsp.runtime.ulysses import AttentionContext, ShardingError  # noqa: E402

CFG = ModelConfig(vocab_size=64, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=64)


@pytest.mark.parametrize("tie", [True, False])
def test_packed_forward_equals_separate_forwards(tie):
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})).double()
    seqs = [torch.randint(1, 64, (n,)) for n in (7, 1, 5)]
    p = pack(seqs, degree=1)
    ctx = AttentionContext(cu_seqlens=p.cu_seqlens, max_seqlen=p.max_seqlen, backend="sdpa")
    packed = model(p.input_ids, p.position_ids, ctx)
    alone = torch.cat([model(s) for s in seqs])   # each from position 0, attending to itself only
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)
    assert packed.shape == (13, 64)


def test_tied_head_shares_the_embedding():
    tied, untied = TinyLM(CFG), TinyLM(ModelConfig(**{**CFG.__dict__, "tie_embeddings": False}))
    assert tied.lm_head is None
    extra = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert extra == CFG.vocab_size * CFG.hidden


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="hidden=30 is not divisible by num_heads=4"):
        ModelConfig(hidden=30, num_heads=4)
    with pytest.raises(ShardingError, match="4 query heads are not a multiple of 3 kv heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
