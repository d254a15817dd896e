"""The local stand-in gives every rank exactly the post-exchange shapes (and its own block exactly
the values) that a real all-to-all over a gloo group gives it, alone and inside the model."""
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from runtime.distributed import run_distributed  # noqa: E402

from flexsp.plan.specs import ModelSpec
from flexsp.replay.exchange import LocalExchange  # noqa: E402
from flexsp.replay.runner import replay_context  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.shard import pack  # noqa: E402
from flexsp.runtime.sp import ulysses  # noqa: E402
from flexsp.runtime.sp.context import AttentionContext
from flexsp.runtime.sp.ulysses_comm import AllToAllExchange

CFG = ModelSpec(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, tie_embeddings=True)
LENGTHS = [7, 3, 5]          # 15 tokens: padded to 16 for degree 4, to 16 for degree 2


def _record_attend(calls):
    real = ulysses.attend

    def recording(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return real(q, k, v, *args, **kwargs)
    return recording


def _model_run(ctx, shard, calls):
    torch.manual_seed(0)
    model = TinyLM(CFG).double()
    calls.clear()
    logits = model(shard.input_ids, shard.position_ids, ctx)
    logits.sum().backward()
    return tuple(logits.shape), list(calls), {n: tuple(p.grad.shape) for n, p in model.named_parameters()}


def _compare(rank, world_size):
    groups = {4: dist.new_group([0, 1, 2, 3])}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups[2] = pairs[rank // 2]
    out = {}
    calls = []
    original = ulysses.attend
    ulysses.attend = _record_attend(calls)
    try:
        for degree, group in groups.items():
            local = dist.get_rank(group)
            real, stand_in = AllToAllExchange(group), LocalExchange(degree, local)
            gen = torch.Generator().manual_seed(100 + rank)
            checks = []
            for heads in (4, 8, 2 * degree):            # q heads, replicated kv heads
                x = torch.randn(16 // degree, heads, 3, generator=gen, dtype=torch.float64)
                a, b = real.seq_to_head(x), stand_in.seq_to_head(x)
                n = x.shape[0]
                own = slice(local * n, (local + 1) * n)      # block of this rank's own tokens
                y = torch.randn(16, heads // degree, 3, generator=gen, dtype=torch.float64)
                c, e = real.head_to_seq(y), stand_in.head_to_seq(y)
                h = heads // degree
                mine = slice(local * h, (local + 1) * h)     # this rank's own head chunk
                checks.append((tuple(a.shape), tuple(b.shape), bool(torch.equal(a[own], b[own])),
                               tuple(c.shape), tuple(e.shape), bool(torch.equal(c[:, mine], e[:, mine]))))
            gen = torch.Generator().manual_seed(7)
            packed = pack([torch.randint(1, CFG.vocab, (n,), generator=gen) for n in LENGTHS], degree)
            shard = packed.shard(local)
            real_ctx = AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, group=group,
                                        backend="sdpa")
            local_ctx = replay_context(packed.cu_seqlens, packed.max_seqlen, stand_in, "sdpa", torch.device("cpu"))
            out[degree] = {"tensors": checks, "real": _model_run(real_ctx, shard, calls),
                           "stand_in": _model_run(local_ctx, shard, calls), "ctx_degree": local_ctx.degree}
    finally:
        ulysses.attend = original
    return out


def test_stand_in_matches_real_exchange_shapes():
    results = run_distributed(_compare, 4, timeout=60)
    for rank, out in enumerate(results):
        for degree, res in out.items():
            assert res["ctx_degree"] == degree
            for real_s2h, local_s2h, own_equal, real_h2s, local_h2s, mine_equal in res["tensors"]:
                assert real_s2h == local_s2h and real_h2s == local_h2s, (rank, degree)
                assert own_equal and mine_equal, (rank, degree)
            logits_real, attend_real, grads_real = res["real"]
            logits_local, attend_local, grads_local = res["stand_in"]
            assert logits_real == logits_local == (16 // degree, CFG.vocab)
            # q [16 tokens, 4/d heads, 8]; kv replicated to 4 heads when d=4 (2 kv heads), else 2/d
            assert attend_real == attend_local and len(attend_real) == CFG.layers
            assert attend_real[0][0] == (16, CFG.heads // degree, CFG.hidden // CFG.heads)
            assert grads_real == grads_local


def test_local_exchange_is_differentiable_and_refuses_bad_shapes():
    ex = LocalExchange(4, 1)
    x = torch.randn(3, 8, 2, requires_grad=True)
    y = ex.head_to_seq(ex.seq_to_head(x) * 2)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert LocalExchange(1, 0).seq_to_head(x) is x
    with pytest.raises(ValueError, match="divisible by 4"):
        ex.seq_to_head(torch.randn(3, 6, 2))
    with pytest.raises(ValueError, match="divisible by 4"):
        ex.head_to_seq(torch.randn(6, 2, 2))
    with pytest.raises(ValueError, match="outside 0..3"):
        LocalExchange(4, 4)
