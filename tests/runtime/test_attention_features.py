"""Per-layer attention features (window, chunk, softcap, sinks) in every CPU kernel and every SP layout,
against the explicit reference (which writes the sink as an extra zero-value key, not as the correction)."""
import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flexsp import Group  # noqa: E402
from flexsp.runtime.kernels import AttentionError, Features, attend, attend_lse, reference  # noqa: E402
from flexsp.runtime.kernels.features import chunked_bounds  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.shard import group_inputs  # noqa: E402
from flexsp.runtime.sp.attention import sp_attention  # noqa: E402
from flexsp.runtime.sp.ring import _block  # noqa: E402
from flexsp.runtime.sp.zigzag import RingTensors, zigzag_layout  # noqa: E402

from .distributed import run_distributed  # noqa: E402

FEATURES = [Features(), Features(window=3), Features(chunk=4), Features(softcap=2.0),
            Features(window=5, chunk=4, softcap=1.5), Features(window=1)]
BOUNDS = (0, 9, 17, 17, 20)      # an empty sequence, and 4 padding rows after the last bound
TOKENS = 24


def _inputs(dtype, heads=4, kv_heads=2, dim=8, seed=0, tokens=TOKENS):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, dim, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=g, dtype=dtype)
    return q, k, v, sinks


def _run(fn, q, k, v, sinks, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = fn(*leaves, s)
    grads = torch.autograd.grad((out * dout).sum(), leaves + ([s] if s is not None else []))
    return out.detach(), grads


@pytest.mark.parametrize("features,sink,backend", list(itertools.product(FEATURES, (False, True),
                                                                         ("sdpa", "sdpa_each", "reference"))))
def test_attend_computes_every_feature_and_keeps_the_padding_contract(features, sink, backend):
    q, k, v, sinks = _inputs(torch.float64)
    sinks = sinks if sink else None
    dout = torch.randn(q.shape, dtype=torch.float64)
    got, grads = _run(lambda q, k, v, s: attend(q, k, v, BOUNDS, backend=backend, features=features, sinks=s),
                      q, k, v, sinks, dout)
    want, wgrads = _run(lambda q, k, v, s: reference(q, k, v, BOUNDS, window=features.window, chunk=features.chunk,
                                                     softcap=features.softcap, sinks=s), q, k, v, sinks, dout)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    real = BOUNDS[-1]
    assert (got[real:] == 0).all() and all((g[real:] == 0).all() for g in grads[:3])   # padding: exactly zero
    if sink:   # the sink's gradient is the reference's, so it is not zero; padding rows added nothing to it
        assert grads[3].abs().sum() > 0


def test_features_change_the_result_and_the_window_masks_what_it_should():
    q, k, v, _ = _inputs(torch.float64)
    plain = attend(q, k, v, BOUNDS, backend="sdpa")
    for features in FEATURES[1:]:
        assert not torch.allclose(attend(q, k, v, BOUNDS, backend="sdpa", features=features), plain)
    # a window of 1: each query sees only itself, so out = its own value row (kv head h // 2)
    one = attend(q, k, v, BOUNDS, backend="sdpa", features=Features(window=1))
    torch.testing.assert_close(one[:20], v.repeat_interleave(2, 1)[:20], rtol=1e-12, atol=1e-12)
    # a window as long as every sequence masks nothing
    torch.testing.assert_close(attend(q, k, v, BOUNDS, backend="sdpa", features=Features(window=9)), plain)


@pytest.mark.parametrize("features", FEATURES)
def test_attend_lse_features_bottom_right_against_the_reference(features):
    q, k, v, _ = _inputs(torch.float64)
    bq, bk = (0, 3, 8, 8, 12), (0, 9, 17, 17, 24)
    dout = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(causal=True, scale=0.3)

    def ours(q, k, v, _):
        out, lse = attend_lse(q, k, v, bq, bk, backend="sdpa", features=features, **kw)
        return out + lse.t().unsqueeze(-1)          # the lse's gradient is checked too

    def ref(q, k, v, _):
        out, lse = reference(q, k, v, bq, bk, return_lse=True, window=features.window, chunk=features.chunk,
                             softcap=features.softcap, **kw)
        return out + torch.where(torch.isinf(lse), 0.0, lse).t().unsqueeze(-1)
    got, grads = _run(ours, q, k, v, None, dout)
    want, wgrads = _run(ref, q, k, v, None, dout)
    got = torch.where(torch.isinf(got), 0.0, got)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_float32_and_bfloat16_run_every_feature():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v, sinks = _inputs(dtype)
        features = Features(window=4, chunk=6, softcap=3.0)
        got = attend(q, k, v, BOUNDS, backend="sdpa", features=features, sinks=sinks)
        want = reference(q.double(), k.double(), v.double(), BOUNDS, window=4, chunk=6, softcap=3.0,
                         sinks=sinks.double())
        assert got.dtype == dtype and (got[20:] == 0).all()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_bad_features_and_sinks_are_refused_by_name():
    with pytest.raises(AttentionError, match="window"):
        Features(window=0)
    with pytest.raises(AttentionError, match="softcap"):
        Features(softcap=-1.0)
    q, k, v, sinks = _inputs(torch.float64)
    with pytest.raises(AttentionError, match="one logit per query head"):
        attend(q, k, v, BOUNDS, backend="sdpa", sinks=sinks[:3])


def test_chunked_bounds_cut_every_sequence_at_its_own_chunks():
    assert chunked_bounds((0, 9, 17, 17, 20), 4) == (0, 4, 8, 9, 13, 17, 17, 20)


# --- ring: block skipping ------------------------------------------------------------------------
def test_ring_skips_blocks_wholly_outside_the_window_and_keeps_the_rest():
    """One long sequence on a ring of 4 (chunks of 8 tokens): a window of 8 leaves the blocks of ring
    neighbours only; each skipped block really is out of reach."""
    lengths, ring = [64], 4
    layout = zigzag_layout(lengths, 1, ring)
    window = Features(window=8)
    kept = plain = 0
    for i in range(ring):
        rt = RingTensors.build(layout, i, "cpu")
        pos = layout.positions(i)
        for j in range(ring):
            full = _block(rt, j, "sdpa", 1.0)
            cut = _block(rt, j, "sdpa", 1.0, window)
            plain += full is not None
            kept += cut is not None
            if full is not None and cut is None:   # skipped: no query of i is within 8 of a key of j
                keys = layout.positions(j) if j > i else layout.positions(j, "first")
                queries = pos if j < i else layout.positions(i, "second")
                assert (queries[:, None] - keys[None, :]).min() >= 8
    # zigzag chunks of 8 tokens: only the diagonal and the ring neighbours' adjacent chunks stay within reach
    assert plain == 16 and kept == 4 + 6


# --- every SP layout, on 8 gloo ranks -------------------------------------------------------------
SPLITS = [(2, 4), (2, 2), (1, 4)]
# (group ranks, ring, lengths): Ulysses 4; Ulysses 2 x ring 2; a pure ring of 4; degree 1 and 2 side by side
GROUPS = {"ulysses": [((0, 1, 2, 3), 1, [13, 2, 9]), ((4, 5), 1, [11, 6]), ((6,), 1, [7, 3]), ((7,), 1, [12])],
          "ring": [((0, 1, 2, 3), 2, [21, 2, 9]), ((4, 5, 6, 7), 4, [3, 1, 26])]}
LAYER_FEATURES = [Features(window=4), Features(chunk=5), Features(softcap=1.5),
                  Features(window=6, chunk=8, softcap=2.0)]


def _data(lengths, tag):
    g = torch.Generator().manual_seed(len(lengths) + 7 * tag)
    total = sum(lengths)
    q, k, v, dout = (torch.randn(total, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    return q, k, v, dout, torch.randn(4, generator=g, dtype=torch.float64)


def _layer_worker(rank, world_size):
    pool = GroupPool(splits=SPLITS)
    results = []
    for kind in ("ulysses", "ring"):
        ranks, ring, lengths = next(g for g in GROUPS[kind] if rank in g[0])
        group = Group(ranks=ranks, seq_ids=tuple(range(len(lengths))), ring=ring)
        _, ctx = group_inputs(group, [torch.zeros(n, dtype=torch.long) for n in lengths], rank, "cpu", pool=pool,
                              backend="sdpa")
        local = ranks.index(rank)
        if ring > 1:
            lay = zigzag_layout(lengths, len(ranks) // ring, ring)
            order = lay.stream_order()[local * lay.rank_tokens:(local + 1) * lay.rank_tokens]
        else:
            per = -(-sum(lengths) // len(ranks))
            order = np.arange(local * per, (local + 1) * per)
            order = np.where(order < sum(lengths), order, -1)
        rows = torch.from_numpy(np.where(order < 0, 0, order))
        real = torch.from_numpy(order >= 0)[:, None, None]
        for tag, (features, sink) in enumerate(itertools.product(LAYER_FEATURES, (False, True))):
            q, k, v, dout, sinks = _data(lengths, tag)
            mine = [torch.where(real, t[rows], 0.0).requires_grad_() for t in (q, k, v)]
            s = sinks.clone().requires_grad_() if sink else None
            out = sp_attention(*mine, ctx, features, s)
            grads = torch.autograd.grad((out * torch.where(real, dout[rows], 0.0)).sum(), mine + ([s] if sink else []))
            results.append({"kind": kind, "tag": tag, "order": order, "out": out.detach(), "grads": grads})
    return results


def test_every_sp_layout_computes_every_feature_exactly():
    runs = run_distributed(_layer_worker, 8, timeout=240)
    for kind in ("ulysses", "ring"):
        for ranks, ring, lengths in GROUPS[kind]:
            total = sum(lengths)
            cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
            for tag, (features, sink) in enumerate(itertools.product(LAYER_FEATURES, (False, True))):
                q, k, v, dout, sinks = _data(lengths, tag)
                want, wgrads = _run(lambda q, k, v, s: reference(q, k, v, cu, window=features.window,
                                                                 chunk=features.chunk, softcap=features.softcap,
                                                                 sinks=s), q, k, v, sinks if sink else None, dout)
                out = np.zeros((total, 4, 8))
                grads = [np.zeros((total, h, 8)) for h in (4, 2, 2)]
                dsink = np.zeros(4)
                for r in ranks:
                    res = next(x for x in runs[r] if x["kind"] == kind and x["tag"] == tag)
                    keep = res["order"] >= 0
                    idx = res["order"][keep]
                    out[idx] = res["out"][keep]
                    assert (res["out"][~keep] == 0).all()
                    for acc, g in zip(grads, res["grads"][:3]):
                        acc[idx] += g[keep]
                        assert (g[~keep] == 0).all()
                    if sink:   # each rank holds the gradient of its own heads' sinks: their sum is the whole
                        dsink += res["grads"][3]
                where = f"{kind} group {ranks} ring {ring}, {features}, sinks {sink}"
                np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12, err_msg=where)
                for got, w in zip(grads, wgrads[:3]):
                    np.testing.assert_allclose(got, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=where)
                if sink:
                    np.testing.assert_allclose(dsink, wgrads[3].numpy(), rtol=1e-10, atol=1e-12, err_msg=where)


# --- the CUDA kernels' API shapes, as hostile stand-ins on CPU ------------------------------------
def _flash_without_softcap(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1)):
    """flash-attn 2.3-2.5's shape: a window, no softcap."""
    from . import hostile
    return hostile.hostile_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  dropout_p, softmax_scale, causal, window_size)


STANDIN_CASES = {   # name: (features, sinks, flash stand-in or None for FA2's, old varlen API, kernel calls expected)
    "varlen window": (Features(window=3), False, None, False, {"forward"}),
    "varlen chunk (cut bounds)": (Features(chunk=4), False, None, False, {"forward"}),
    "varlen window + sinks (lse correction)": (Features(window=3), True, None, False, {"forward", "backward"}),
    "softcap -> flash-attn 2's softcap": (Features(window=3, softcap=2.0), False, None, False, {"flash"}),
    "softcap, flash-attn without it -> sdpa": (Features(softcap=2.0), False, _flash_without_softcap, False, set()),
    "learnable_sink (FA4 shape)": (Features(window=3), True, "sink", False, {"flash_sink"}),
    "torch 2.10 varlen (is_causal) window -> flash-attn's window": (Features(window=3), False, _flash_without_softcap,
                                                                     True, {"flash"}),
    "torch 2.10 varlen (is_causal) window + sinks -> sdpa": (Features(window=3), True, _flash_without_softcap, True,
                                                              set()),
}


@pytest.mark.parametrize("case", sorted(STANDIN_CASES))
def test_cuda_kernel_shapes_compute_the_features_or_fall_back(monkeypatch, case):
    import dataclasses

    from flexsp.runtime.kernels import varlen as varlen_mod
    from . import hostile
    features, sink, flash_fn, old_varlen, want_ops = STANDIN_CASES[case]
    if flash_fn == "sink":
        flash_fn = hostile.hostile_flash_attn_varlen_sink_func
    facts = hostile.FACTS if flash_fn is None or flash_fn is _flash_without_softcap else \
        dataclasses.replace(hostile.FACTS, flash=2)
    hostile.install(monkeypatch.setattr, float("nan"), facts, flash=flash_fn)
    if old_varlen:   # torch 2.10/2.11: is_causal, no window_size: a window cannot be passed to varlen
        monkeypatch.setattr(varlen_mod, "VARLEN", dataclasses.replace(varlen_mod.VARLEN, causal_arg="is_causal"))
    q, k, v, sinks = _inputs(torch.float64)
    backend = "flash" if want_ops & {"flash_sink"} else "auto"
    dout = torch.randn(q.shape, dtype=torch.float64)
    got, grads = _run(lambda q, k, v, s: attend(q, k, v, BOUNDS, max_seqlen=9, backend=backend, features=features,
                                                sinks=s), q, k, v, sinks if sink else None, dout)
    want, wgrads = _run(lambda q, k, v, s: reference(q, k, v, BOUNDS, window=features.window, chunk=features.chunk,
                                                     softcap=features.softcap, sinks=s), q, k, v,
                        sinks if sink else None, dout)
    assert {c["op"] for c in hostile.Trace.calls} == want_ops, hostile.Trace.calls
    if features.window is not None:   # the kernel was told the window, never run without it
        assert all(c["window"] == features.window - 1 for c in hostile.Trace.calls), hostile.Trace.calls
    # the stand-ins keep a float32 lse, as the kernels do: ~1e-7 in the backward and in a sink's correction
    tol = dict(rtol=1e-6, atol=1e-6) if sink else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    real = BOUNDS[-1]
    assert (got[real:] == 0).all() and all((g[real:] == 0).all() for g in grads[:3])


def test_the_lse_form_runs_varlen_only_where_it_computes_the_layer(monkeypatch):
    """The ring's and attend_lse's kernel: varlen for a bottom-right window (its backward op takes
    window_size), the per-sequence form for explicit positions (zigzag blocks), a chunk or a softcap."""
    from flexsp.runtime.kernels.capability import lse_kernel
    from . import hostile
    hostile.install(monkeypatch.setattr, float("nan"))
    assert lse_kernel("varlen", Features(), True) == "varlen"
    assert lse_kernel("varlen", Features(window=3), False) == "varlen"
    assert lse_kernel("varlen_cudnn", Features(window=3), False) == "varlen"
    for features, positions in ((Features(window=3), True), (Features(chunk=3), False), (Features(softcap=1.0), False)):
        assert lse_kernel("varlen", features, positions) == "sdpa"
    q, k, v, _ = _inputs(torch.float64)
    bq, bk = (0, 3, 8, 8, 12), (0, 9, 17, 17, 24)
    out, lse = attend_lse(q, k, v, bq, bk, causal=True, features=Features(window=3))
    want, wlse = reference(q, k, v, bq, bk, return_lse=True, window=3)
    assert {c["op"] for c in hostile.Trace.calls} == {"forward"} and hostile.Trace.calls[0]["window"] == 2
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), wlse, rtol=1e-6, atol=1e-6)
    assert (out[12:] == 0).all() and torch.isinf(lse[:, 12:]).all()


def test_sinks_on_merged_statistics_through_a_hostile_kernel_are_exact(monkeypatch):
    """The ring's way with sinks: partials over two key blocks merged, the sink applied once to the merged
    statistics, every block's q/k/v gradient from the augmented statistics (through the varlen stand-in's
    FA2-style backward, NaN in its padding rows) and the sink's from one reduction - all equal to attention
    over the union of the keys with the sink as an extra key."""
    from flexsp.runtime.kernels import LseSpec, lse_backward, lse_forward, merge_partials
    from flexsp.runtime.kernels.sinks import sink_grad, sink_stats
    from . import hostile
    hostile.install(monkeypatch.setattr, float("nan"))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 8, generator=g, dtype=torch.float64) for n, h in ((12, 4), (15, 2), (15, 2)))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    cu_q = (0, 5, 10)                                                  # rows 10, 11: padding
    blocks = [((0, 3, 6), slice(0, 8)), ((0, 2, 4), slice(8, 15))]     # keys 0..5 | 8..11 real
    specs = [LseSpec(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 5, 3, False, 0.25,
                     "varlen") for cu_k, _ in blocks]
    (oa, la), (ob, lb) = (lse_forward(q, k[rows], v[rows], spec) for (_, rows), spec in zip(blocks, specs))
    out, lse = sink_stats(*merge_partials(oa, la, ob, lb), sinks)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    for (cu_k, rows), spec in zip(blocks, specs):
        gq, gk, gv = lse_backward(dout, q, k[rows], v[rows], out, lse, spec)
        dq += gq
        dk[rows] += gk
        dv[rows] += gv
    dsink = sink_grad(dout, out, lse, sinks)
    keep = torch.tensor([0, 1, 2, 8, 9, 3, 4, 5, 10, 11])
    leaves = [t.clone().requires_grad_() for t in (q, k[keep], v[keep], sinks)]
    want = reference(*leaves[:3], cu_q, (0, 5, 10), causal=False, scale=0.25, sinks=leaves[3])
    wq, wk, wv, ws = torch.autograd.grad((want * dout).sum(), leaves)
    tol = dict(rtol=1e-6, atol=1e-6)   # the stand-in's float32 lse
    torch.testing.assert_close(out, want.detach(), **tol)
    assert (out[10:] == 0).all() and torch.isinf(lse[:, 10:]).all()
    torch.testing.assert_close(dq, wq, **tol)
    torch.testing.assert_close(dk[keep], wk, **tol)
    torch.testing.assert_close(dv[keep], wv, **tol)
    torch.testing.assert_close(dsink, ws, **tol)
    assert (dq[10:] == 0).all()
