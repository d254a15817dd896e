"""Ulysses attention over pooled groups equals one-process attention over the same packed tokens."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.kernels import attend  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.sp.context import AttentionContext, ShardingError
from flexsp.runtime.sp.ulysses import ulysses_attention

from .distributed import run_distributed  # noqa: E402

DIM = 4
# Layouts of a 4-rank world: which groups run at the same time. Mixed sizes run side by side.
LAYOUTS = [
    ((0, 1, 2, 3),),
    ((0, 1), (2, 3)),
    ((0, 1), (2,), (3,)),
    ((0,), (1,), (2,), (3,)),
]
HEADS = [(4, 4), (4, 2), (4, 1), (8, 2)]   # MHA, GQA, MQA (kv heads < degree 4 -> replicated), GQA


def _lengths(ranks, case):
    """Different, uneven token counts per group (never a multiple of the degree)."""
    first = ranks[0]
    return [5 + first + case, 3, 2 + 2 * first] if len(ranks) > 1 else [4 + first + case, 3]


def _full_inputs(lengths, heads, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, DIM, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    w = torch.randn(tokens, heads, DIM, generator=g, dtype=torch.float64)   # d(loss)/d(out)
    return q, k, v, w


def _pad(x, tokens):
    return torch.cat([x, x.new_zeros(tokens - x.shape[0], *x.shape[1:])])


def _ulysses_worker(rank, world_size):
    pool = GroupPool()
    worst = 0.0
    checked = []
    for case, (heads, kv_heads) in enumerate(HEADS):
        for layout in LAYOUTS:
            ranks = next(r for r in layout if rank in r)
            d, local = len(ranks), ranks.index(rank)
            lengths = _lengths(ranks, case)
            seed = 1000 * case + ranks[0]   # the same inputs on every rank of a group
            q, k, v, w = _full_inputs(lengths, heads, kv_heads, seed)
            cu = tuple(int(x) for x in torch.tensor([0] + lengths).cumsum(0))
            # Reference: one process, whole group, explicit softmax.
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = attend(*leaves, cu, backend="reference")
            ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
            # Ulysses: this rank's shard of the padded stream.
            padded = -(-cu[-1] // d) * d
            n = padded // d
            part = slice(local * n, (local + 1) * n)
            shards = [_pad(t, padded)[part].clone().requires_grad_() for t in (q, k, v)]
            ctx = AttentionContext.packed(cu, group=pool.get(ranks), backend="sdpa")
            out = ulysses_attention(*shards, ctx)
            grads = torch.autograd.grad((out * _pad(w, padded)[part]).sum(), shards)
            real = max(0, min(n, cu[-1] - local * n))
            torch.testing.assert_close(out[:real], ref[part][:real], rtol=1e-10, atol=1e-12)
            assert (out[real:] == 0).all()
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(got[:real], _pad(want, padded)[part][:real], rtol=1e-10, atol=1e-12)
                assert (got[real:] == 0).all()
            if real:
                worst = max(worst, float((out[:real] - ref[part][:real]).detach().abs().max()))
            checked.append((heads, kv_heads, d, cu[-1] % d))
    return worst, checked


def test_ulysses_equals_single_process_attention():
    results = run_distributed(_ulysses_worker, 4)
    checked = {c for _, cases in results for c in cases}
    assert {c[2] for c in checked} == {1, 2, 4}
    assert any(c[2] > 1 and c[3] for c in checked)          # uneven token counts were exercised
    assert any(c[1] < c[2] for c in checked)                 # kv heads fewer than the degree (replicated)
    assert max(w for w, _ in results) < 1e-12


def _indivisible_heads_worker(rank, world_size):
    pool = GroupPool()
    ctx = AttentionContext.packed((0, 8), group=pool.get((0, 1, 2, 3)))
    q = torch.randn(2, 6, DIM)
    with pytest.raises(ShardingError, match=r"degree 4 does not divide the 6 attention heads.*\[1, 2, 3, 6\]"):
        ulysses_attention(q, q, q, ctx)
    return "raised"


def test_heads_not_divisible_by_degree_is_a_clear_error():
    assert run_distributed(_indivisible_heads_worker, 4) == ["raised"] * 4
