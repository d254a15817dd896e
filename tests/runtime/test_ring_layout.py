"""Zigzag layout (one process): every token once, blocks that tile the causal mask exactly, balanced
causal work, and the ring's block recurrence (forward and backward, comm simulated) equal to full attention."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.kernels import attend_lse, lse_backward, lse_forward, merge_partials  # noqa: E402
from flexsp.runtime.sp.ring import _block  # noqa: E402
from flexsp.runtime.sp.ring_comm import place, ring_blocks, split_blocks  # noqa: E402
from flexsp.runtime.sp.zigzag import RingTensors, zigzag_layout, zigzag_pack  # noqa: E402

LAYOUTS = [  # (lengths, ulysses, ring): divisible, not divisible, shorter than the ring, single tokens
    ([16, 24], 2, 4),
    ([13, 5, 9], 2, 2),
    ([3, 1, 7, 2], 1, 4),
    ([1], 2, 4),
    ([11, 6], 4, 2),
    ([17, 4, 2], 2, 3),        # rings and Ulysses parts of any size (non-power-of-two degrees)
    ([20, 9], 3, 2),
    ([1, 12, 31], 1, 5),
    ([7, 3], 3, 3),
]


def _true_mask(lengths):
    seq = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(sum(lengths))
    return (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])


@pytest.mark.parametrize("lengths,ulysses,ring", LAYOUTS)
def test_every_token_once_and_slices_tile_the_stream(lengths, ulysses, ring):
    lay = zigzag_layout(lengths, ulysses, ring)
    orders = [lay.order(j) for j in range(ring)]
    assert sorted(np.concatenate(orders).tolist()) == list(range(sum(lengths)))
    assert lay.shard_tokens % ulysses == 0 and lay.shard_tokens >= max(o.size for o in orders)
    for j, o in enumerate(orders):
        assert (np.diff(o) > 0).all()                      # a shard keeps the stream's order
        assert lay.cu_local(j)[-1] == o.size == lay.real_tokens(j)
    ids = [torch.arange(n) + 1000 * (s + 1) for s, n in enumerate(lengths)]
    packed = zigzag_pack(ids, ulysses, ring)
    shards = [packed.shard(r) for r in range(ulysses * ring)]
    real = sorted(t for sh in shards for t in sh.input_ids[:sh.real_tokens].tolist())
    assert real == sorted(torch.cat(ids).tolist())
    flat = torch.cat(ids)
    for sh in shards:    # labels are the next token of the same sequence, positions restart per sequence
        for tok, pos, lab in zip(*(x[:sh.real_tokens].tolist() for x in (sh.input_ids, sh.position_ids, sh.labels))):
            s = tok // 1000 - 1
            assert pos == tok - 1000 * (s + 1)
            assert lab == (tok + 1 if pos + 1 < lengths[s] else -100)
    assert sum(sh.real_tokens for sh in shards) == len(flat)


@pytest.mark.parametrize("lengths,ulysses,ring", LAYOUTS)
def test_blocks_tile_the_causal_mask(lengths, ulysses, ring):
    """For each ring rank i, the union over j of block masks is exactly the true causal mask of i's rows."""
    lay = zigzag_layout(lengths, ulysses, ring)
    truth = _true_mask(lengths)
    from flexsp.runtime.kernels import block_mask
    for i in range(ring):
        rt = RingTensors.build(lay, i, "cpu")
        rows_i = lay.order(i)
        seen = np.zeros((rows_i.size, sum(lengths)), dtype=int)
        for j in range(ring):
            rows_j = lay.order(j)
            block = _block(rt, j, "sdpa", 1.0)
            if block is None:
                continue
            q_rows, kv_rows, spec = block
            qi = np.arange(rows_i.size) if q_rows is None else q_rows.numpy()
            kj = np.arange(rows_j.size) if kv_rows is None else kv_rows.numpy()
            allowed = block_mask(spec.cu_q, spec.cu_k, qi.size, kj.size, spec.causal).numpy()
            seen[np.ix_(qi, rows_j[kj])] += allowed
        assert (seen <= 1).all()                             # no key counted twice
        assert (seen.astype(bool) == truth[rows_i]).all()    # and none missed


@pytest.mark.parametrize("ring", [4, 3, 5])
def test_zigzag_balances_causal_work(ring):
    lay = zigzag_layout([16 * ring, 32 * ring, 8 * ring], 1, ring)   # whole chunks: rounding aside
    truth = _true_mask(lay.lengths)
    work = [truth[lay.order(j)].sum() for j in range(ring)]
    assert max(work) / min(work) < 1.05
    one = _true_mask([256])                  # for contrast: each sequence cut into 4 contiguous chunks
    contiguous = [one[a:a + 64].sum() for a in range(0, 256, 64)]
    assert max(contiguous) / min(contiguous) > 6


@pytest.mark.parametrize("ring", [4, 3, 5])
def test_ring_recurrence_equals_full_attention_forward_and_backward(ring):
    """The ring's forward merge and backward share-passing, with the hops replaced by indexing."""
    lengths = [13, 5, 9]
    lay = zigzag_layout(lengths, 1, ring)
    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    full, _ = attend_lse(q, k, v, cu, cu, causal=True, backend="reference")
    dout = torch.randn(full.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((full * dout).sum(), (q, k, v))

    def shard(x, j):
        rows = torch.from_numpy(lay.order(j))
        out = x.new_zeros((lay.shard_tokens,) + x.shape[1:])
        out[:rows.numel()] = x.detach()[rows]
        return out

    tensors = [RingTensors.build(lay, i, "cpu") for i in range(ring)]
    outs, lses = [], []
    for i in range(ring):
        out = torch.zeros(lay.shard_tokens, 4, 8, dtype=torch.float64)
        lse = torch.full((4, lay.shard_tokens), -math.inf, dtype=torch.float64)
        for j in range(ring):
            block = _block(tensors[i], j, "sdpa", 1 / math.sqrt(8))
            if block is None:
                continue
            q_rows, kv_rows, spec = block
            sel = lambda x, r: x if r is None else x[r]  # noqa: E731
            o, l_ = lse_forward(sel(shard(q, i), q_rows), sel(shard(k, j), kv_rows), sel(shard(v, j), kv_rows), spec)
            if q_rows is None:
                out, lse = merge_partials(out, lse, o, l_)
            else:
                o, l_ = merge_partials(out[q_rows], lse[:, q_rows], o, l_)
                out[q_rows], lse[:, q_rows] = o, l_
        outs.append(out)
        lses.append(lse)
    got = torch.zeros_like(full)
    for i in range(ring):
        rows = torch.from_numpy(lay.order(i))
        got[rows] = outs[i][:rows.numel()]
    torch.testing.assert_close(got, full.detach(), rtol=1e-10, atol=1e-12)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i in range(ring):
        rows_i = torch.from_numpy(lay.order(i))
        for j in range(ring):
            block = _block(tensors[i], j, "sdpa", 1 / math.sqrt(8))
            if block is None:
                continue
            q_rows, kv_rows, spec = block
            rows_j = torch.from_numpy(lay.order(j))
            qi = torch.arange(rows_i.numel()) if q_rows is None else q_rows
            kj = torch.arange(rows_j.numel()) if kv_rows is None else kv_rows
            dq, dk, dv = lse_backward(shard(dout, i)[qi], shard(q, i)[qi], shard(k, j)[kj], shard(v, j)[kj],
                                      outs[i][qi], lses[i][:, qi], spec)
            grads[0].index_add_(0, rows_i[qi], dq)
            grads[1].index_add_(0, rows_j[kj], dk)
            grads[2].index_add_(0, rows_j[kj], dv)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ring_placement_and_fixed_order():
    assert ring_blocks(8, [(2, 4), (2, 2)]) == [(0, 2), (1, 3), (4, 6), (5, 7), (0, 2, 4, 6), (1, 3, 5, 7)]
    assert ring_blocks(8, [(1, 4)]) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert place(5, (0, 1, 2, 3, 4, 5, 6, 7), 2) == ((4, 5), (1, 3, 5, 7), 2)
    assert place(6, (4, 5, 6, 7), 1) == ((6,), (4, 5, 6, 7), 2)


def test_hybrid_blocks_of_any_size_sit_on_tiles():
    """Ulysses sub-groups are consecutive from each tile's start, rings stride the Ulysses part; tiles of
    6 on nodes of 6 and of 3 inside them, whatever the sizes."""
    subs, rings = split_blocks(12, [(2, 3), (1, 3)], 6)
    assert subs == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    assert rings == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11), (0, 2, 4), (1, 3, 5), (6, 8, 10), (7, 9, 11)]
    assert split_blocks(12, [(3, 2)], 6)[1] == [(0, 3), (1, 4), (2, 5), (6, 9), (7, 10), (8, 11)]
    assert ring_blocks(10, [(1, 5)], 10) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    for rank in range(12):   # place() agrees with the blocks: this rank's sub-group and ring are listed
        tile = tuple(range(rank // 6 * 6, rank // 6 * 6 + 6))
        sub, ring, index = place(rank, tile, 2)
        assert sub in subs and ring in rings and ring[index] == rank


def test_pool_splits_follow_the_ulysses_limit_and_the_degrees():
    from flexsp import PlanError
    from flexsp.runtime.sp.ring_comm import pool_splits as _splits
    assert _splits((1, 2, 4, 8), None, 2) == ((2, 2), (2, 4))         # as the planner splits past the limit
    assert _splits((1, 8), None, 2) == ((2, 4),)                      # degrees= bounds them
    assert _splits((1, 2, 4, 8), [(1, 4), (4, 1)], None) == ((1, 4),)  # ring 1 is plain Ulysses
    assert _splits((1, 2, 4, 8), None, 16) == ()
    with pytest.raises(PlanError, match=r"split 2 x 8 is a group of 16 GPUs, not a pooled degree"):
        _splits((1, 2, 4, 8), [(2, 8)], None)
    assert _splits((1, 3, 6, 12), [(3, 2), (1, 3)], None) == ((1, 3), (3, 2))   # any sizes whose product is pooled
    assert _splits((1, 3, 6, 12), None, None, heads=4) == ((1, 3), (2, 3), (4, 3))   # gcd(d, heads) x the rest
    assert _splits((1, 2, 4, 8), None, None, heads=2) == _splits((1, 2, 4, 8), None, 2)   # the limit, for powers of two
    with pytest.raises(PlanError, match=r"split 3 x 2 is a group of 6 GPUs, not a pooled degree"):
        _splits((1, 2, 4, 8), [(3, 2)], None)
    with pytest.raises(PlanError, match="must be >= 1"):
        _splits((1, 2, 4, 8), [(0, 2)], None)
    with pytest.raises(PlanError, match="ulysses_limit must be a power of two"):
        _splits((1, 2), None, 3)


def test_each_hop_is_in_flight_while_a_block_is_computed(monkeypatch):
    """Event order on one rank (hops looped back): start hop, compute the current block, then wait -
    forward and backward; the backward's dK/dV sums hop once per foreign block."""
    import flexsp.runtime.sp.ring as ring_mod
    from flexsp.runtime.sp.ring_comm import Pending

    events = []

    class Recorder:
        size, index = 4, 2

        def hop(self, x, tag=0):
            events.append(f"hop{tag}")
            pending = Pending(x.clone(), [], x)
            wait = pending.wait
            pending.wait = lambda: (events.append(f"wait{tag}"), wait())[1]
            return pending

    for name in ("lse_forward", "lse_backward"):
        real = getattr(ring_mod, name)
        monkeypatch.setattr(ring_mod, name, lambda *a, _real=real, _name=name, **k: (events.append(_name[4:]),
                                                                                     _real(*a, **k))[1])
    lay = zigzag_layout([16, 8], 1, 4)
    rt = RingTensors.build(lay, 2, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(lay.shard_tokens, h, 8, generator=g, dtype=torch.float64).requires_grad_() for h in (2, 1, 1))
    out = ring_mod._RingAttention.apply(q, k, v, rt, Recorder(), "sdpa", 0.5)
    forward = list(events)
    assert forward == ["hop0", "forward", "wait0"] * 3 + ["forward"]
    events.clear()
    out.sum().backward()
    assert events == (["hop0", "backward"]                                            # diagonal block
                      + ["wait0", "hop0", "backward", "hop1"]                         # step 1
                      + ["wait0", "hop0", "backward", "wait1", "hop1"]                # step 2
                      + ["wait0", "backward", "wait1", "hop1", "wait1"])              # step 3, own sums home
