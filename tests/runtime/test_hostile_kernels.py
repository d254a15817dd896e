"""The padding contract against hostile kernels: stand-ins for ``varlen_attn`` and flash-attn that are exact
on real rows and write NaN or 1e30 into every row they do not own (forward output, lse, dq/dk/dv), as
uninitialised GPU memory may. ``attend``, ``attend_lse``, the ring's ``lse_backward`` with merged
statistics and ``merge_partials`` still give exactly zero output and gradient on padding rows and the
reference on real rows; a planned step on gloo ranks at degrees 1, 2, 4 and Ulysses x ring, fp32 and
bf16, with the stand-ins in every rank, gives the one-process gradients."""
import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.kernels import LseSpec, attend, attend_lse, lse_backward, lse_forward, merge_partials, reference  # noqa: E402
from flexsp.runtime.kernels.rule import DeviceFacts  # noqa: E402

from . import hostile  # noqa: E402
from .distributed import run_distributed  # noqa: E402

NAN, HUGE = float("nan"), 1e30
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
       torch.float64: dict(rtol=1e-9, atol=1e-10)}


def _qkv(tq, heads, kv_heads, dtype, tk=None, dim=16, seed=0, v_dim=None):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, h, d=dim: torch.randn(n, h, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    tk = tq if tk is None else tk
    return make(tq, heads), make(tk, kv_heads), make(tk, kv_heads, dim if v_dim is None else v_dim)


def _weights(like, seed):
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(like.dtype)


def _exact(q, k, v, cu_q, cu_k=None, causal=True, scale=None):
    """The float64 reference of the same inputs (leaves of their own; a narrower v padded for it and cut back)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    width = v64.shape[-1]
    out, lse = reference(q64, k64, F.pad(v64, (0, q64.shape[-1] - width)), cu_q, cu_k, causal=causal, return_lse=True,
                         scale=scale)
    return (q64, k64, v64), out[..., :width], lse


def _zero_rows(t, start):
    return bool((t[start:] == 0).all()) and bool(torch.isfinite(t).all())


@pytest.fixture(params=[NAN, HUGE], ids=["nan", "1e30"])
def poison(request, monkeypatch):
    hostile.install(monkeypatch.setattr, request.param)
    return request.param


@pytest.mark.parametrize("scale", [None, 0.3], ids=["1/sqrt(dim)", "the model's own"])   # Gemma 2, Granite: scale=
@pytest.mark.parametrize("v_dim", [16, 12], ids=["v as q", "latent v"])   # latent attention: v narrower than q/k
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["varlen", "flash", "auto"])
def test_attend_zero_on_padding_reference_on_real_rows(poison, backend, dtype, v_dim, scale):
    cu = (0, 6, 7, 7, 13)                                    # an empty sequence, then 3 padding rows
    q, k, v = _qkv(16, 4, 2, dtype, v_dim=v_dim)
    out = attend(q, k, v, torch.tensor(cu, dtype=torch.int32), max_seqlen=6, backend=backend, scale=scale)
    grads = torch.autograd.grad((out.double() * _weights(out, 1).double()).sum(), (q, k, v))
    assert hostile.Trace.calls, "the stand-in did not run"
    assert _zero_rows(out, 13) and all(_zero_rows(g, 13) for g in grads)
    leaves, want, _ = _exact(q, k, v, cu, scale=scale)
    want_grads = torch.autograd.grad((want * _weights(out, 1).double()).sum(), leaves)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), exp, **TOL[dtype])


CASES = [  # (tq, tk, cu_q, cu_k, causal): padding on both sides, a sequence without keys, unequal lengths
    (15, 15, (0, 5, 9, 12), (0, 5, 9, 12), True),
    (11, 14, (0, 4, 4, 9), (0, 6, 8, 12), False),
    (10, 13, (0, 3, 8), (0, 0, 11), True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tq,tk,cu_q,cu_k,causal", CASES)
def test_attend_lse_zero_on_padding_through_both_outputs(poison, tq, tk, cu_q, cu_k, causal, dtype):
    q, k, v = _qkv(tq, 4, 2, dtype, tk=tk)
    i32 = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    out, lse = attend_lse(q, k, v, i32(cu_q), i32(cu_k), max_seqlen_q=tq, max_seqlen_k=tk, causal=causal,
                          backend="varlen")
    assert [c["op"] for c in hostile.Trace.calls] == ["forward"]
    finite = torch.where(torch.isinf(lse), 0.0, lse)
    loss = (out.double() * _weights(out, 2).double()).sum() + (finite.double() * _weights(lse, 3).double()).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    assert _zero_rows(out, cu_q[-1]) and bool((lse[:, cu_q[-1]:] == -math.inf).all())
    assert _zero_rows(grads[0], cu_q[-1]) and _zero_rows(grads[1], cu_k[-1]) and _zero_rows(grads[2], cu_k[-1])
    leaves, want, want_lse = _exact(q, k, v, cu_q, cu_k, causal)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    want_finite = torch.where(torch.isinf(want_lse), 0.0, want_lse)
    want_grads = torch.autograd.grad((want * _weights(out, 2).double()).sum()
                                     + (want_finite * _weights(lse, 3).double()).sum(), leaves)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    torch.testing.assert_close(finite.double(), want_finite, **TOL[dtype])
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), exp, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_backward_with_merged_statistics_is_zero_on_padding(poison, dtype):
    """The ring's way: partials over two key blocks merged, each block's gradient from the merged (out, lse),
    statistics whose padding rows hold garbage - their sum is the full attention's gradient."""
    tq, cu_q = 12, (0, 5, 10)
    q, k, v = _qkv(tq, 4, 2, dtype, tk=15, seed=4)
    blocks = [((0, 3, 6), slice(0, 8)), ((0, 2, 4), slice(8, 15))]   # keys 0..5 | 8..11 real, 6-7 and 12-14 padding
    parts, specs = [], []
    with torch.no_grad():
        for cu_k, rows in blocks:
            spec = LseSpec(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), 5, 3, False,
                           0.25, "varlen")
            specs.append(spec)
            parts.append(lse_forward(q, k[rows], v[rows], spec))
        (oa, la), (ob, lb) = parts
        assert _zero_rows(oa, 10) and bool((la[:, 10:] == -math.inf).all())
        out, lse = merge_partials(oa, la, ob, lb)
        dout = _weights(out, 5)
        garbage_out = out.clone()
        garbage_out[10:] = NAN                               # what a kernel may leave in the merged statistics
        garbage_lse = lse.clone()
        garbage_lse[:, 10:] = NAN
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk = torch.zeros(k.shape, dtype=torch.float64)
        dv = torch.zeros(v.shape, dtype=torch.float64)
        for (cu_k, rows), spec in zip(blocks, specs):
            gq, gk, gv = lse_backward(dout, q, k[rows], v[rows], garbage_out, garbage_lse, spec)
            assert _zero_rows(gq, 10) and _zero_rows(gk, cu_k[-1]) and _zero_rows(gv, cu_k[-1])
            dq += gq.double()
            dk[rows] += gk.double()
            dv[rows] += gv.double()
    # the same as one partial over the union of the real keys
    keep = torch.tensor([0, 1, 2, 8, 9, 3, 4, 5, 10, 11])
    ref_out, ref_grads = _union_reference(q, k, v, keep, cu_q, dout)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    full_dk = torch.zeros(k.shape, dtype=torch.float64).index_add_(0, keep, ref_grads[1])
    full_dv = torch.zeros(v.shape, dtype=torch.float64).index_add_(0, keep, ref_grads[2])
    torch.testing.assert_close(dq, ref_grads[0], **TOL[dtype])
    torch.testing.assert_close(dk, full_dk, **TOL[dtype])
    torch.testing.assert_close(dv, full_dv, **TOL[dtype])


def _union_reference(q, k, v, keep, cu_q, dout):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k[keep], v[keep]))
    out = reference(q64, k64, v64, cu_q, (0, 5, 10), causal=False, scale=0.25)
    return out.detach(), torch.autograd.grad((out * dout.double()).sum(), (q64, k64, v64))


def test_merge_ignores_garbage_in_a_partial_that_saw_no_key():
    out_a = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    lse_a = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    junk = torch.full((4, 2, 3), NAN, dtype=torch.float64).requires_grad_()
    empty = torch.full((2, 4), -math.inf, dtype=torch.float64).requires_grad_()
    out, lse = merge_partials(out_a, lse_a, junk, empty)
    assert torch.equal(out, out_a) and torch.allclose(lse, lse_a)
    grads = torch.autograd.grad((out * 2).sum() + lse.sum(), (out_a, lse_a, junk, empty))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert bool((grads[2] == 0).all())


def _ran(op=None):
    return [(c["op"], c["backend"], c["kv_heads"]) for c in hostile.Trace.calls if op is None or c["op"] == op]


def test_cudnn_varlen_where_its_constraints_hold_with_the_forwards_backend_in_backward(monkeypatch):
    """The newer varlen_attn on a faked Hopper: a long GQA micro-batch runs cuDNN (kv heads repeated) forward
    and backward - the backward op told ``backend=cuDNN`` - exact, padding rows zero."""
    hostile.install(monkeypatch.setattr, NAN, selecting=True)
    q, k, v = _qkv(300, 4, 2, torch.bfloat16)                    # cuDNN takes fp16/bf16 only
    bounds = (0, 200, 290)                                       # longest 200 > 128; 10 padding rows
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = attend(q, k, v, cu, max_seqlen=200, bounds=bounds, backend="auto")
    grads = torch.autograd.grad((out * _weights(out, 2)).sum(), (q, k, v))
    assert _ran() == [("forward", "cudnn", 4), ("backward", "cudnn", 4)]
    assert not any(c["cudnn"] for c in hostile.Trace.calls)      # never cuDNN alone: Flash enabled beside it
    assert _zero_rows(out, 290) and all(_zero_rows(g, 290) for g in grads)
    leaves, want, _ = _exact(q, k, v, bounds)
    torch.testing.assert_close(out.double(), want, **TOL[torch.bfloat16])
    for got, exp in zip(grads, torch.autograd.grad((want * _weights(out, 2).double()).sum(), leaves)):
        torch.testing.assert_close(got.double(), exp, **TOL[torch.bfloat16])


@pytest.mark.parametrize("backend", ["auto", "varlen_cudnn"])
@pytest.mark.parametrize("bounds,rows", [((0, 1), 8), ((0, 100, 128), 136)], ids=["idle dummy", "128 tokens"])
def test_idle_dummy_and_short_micro_batches_never_reach_cudnn(monkeypatch, backend, bounds, rows):
    """The executor's one-token idle micro-batch and micro-batches of <= 128 tokens: Flash, forward and
    backward, even when varlen_cudnn is asked for (cuDNN would raise there with only itself enabled)."""
    hostile.install(monkeypatch.setattr, NAN, selecting=True)
    q, k, v = _qkv(rows, 4, 2, torch.bfloat16)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    out = attend(q, k, v, torch.tensor(bounds, dtype=torch.int32), max_seqlen=longest, bounds=bounds,
                 backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert {b for _, b, _ in _ran()} == {"flash"} and len(_ran()) == 2
    assert _zero_rows(out, bounds[-1]) and all(_zero_rows(g, bounds[-1]) for g in grads)


def test_the_stand_in_raises_where_only_cudnn_is_enabled_and_its_constraints_fail(monkeypatch):
    """What the previous varlen_cudnn (cuDNN alone) met on such a torch: the test above can fail."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hostile.install(monkeypatch.setattr, NAN, selecting=True)
    q, k, v = _qkv(8, 4, 4, torch.bfloat16)
    cu = torch.tensor((0, 1), dtype=torch.int32)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), pytest.raises(RuntimeError, match="max_q must be greater"):
        hostile.selecting_varlen_attn(q, k, v, cu, cu, 1, 1, window_size=(-1, 0))


def test_ring_blocks_with_their_own_bounds_and_plain_varlen_run_flash(monkeypatch):
    """A causal lse call with distinct q/k bound tensors (the ring's) cannot take cuDNN; ``varlen`` on a
    torch that would pick eligible cuDNN by itself is held to Flash. Both backwards get ``backend=Flash``."""
    hostile.install(monkeypatch.setattr, NAN, selecting=True)
    q, k, v = _qkv(300, 4, 4, torch.bfloat16)
    cu_q, cu_k = torch.tensor((0, 200, 290), dtype=torch.int32), torch.tensor((0, 200, 290), dtype=torch.int32)
    out, lse = attend_lse(q, k, v, cu_q, cu_k, max_seqlen_q=200, max_seqlen_k=200, causal=True,
                          backend="varlen_cudnn")
    torch.autograd.grad(out.sum(), (q, k, v))
    assert _ran() == [("forward", "flash", 4), ("backward", "flash", 4)]
    hostile.Trace.calls.clear()
    out = attend(q, k, v, cu_q, max_seqlen=200, backend="varlen")
    torch.autograd.grad(out.sum(), (q, k, v))
    assert _ran() == [("forward", "flash", 4), ("autograd backward", "flash", 4)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_a_torch_that_takes_cudnn_by_itself_keeps_flash_in_the_lse_forms(monkeypatch, heads, kv_heads):
    """torch 2.14 takes cuDNN inside ``varlen_attn`` wherever it is eligible (non-causal, no GQA, max_q > 128),
    decides again in its backward op and has no selection to ask for Flash; cuDNN's statistics need not be
    Flash's ``[heads, tokens]``. The ring's lse forms (a non-causal block; the backward op fed merged
    statistics) stay exact: a covering window holds every call to Flash."""
    hostile.install(monkeypatch.setattr, NAN, auto=True)
    tq, tk, cu_q, cu_k = 300, 260, (0, 200, 290), (0, 150, 250)
    q, k, v = _qkv(tq, heads, kv_heads, torch.float32, tk=tk)
    i32 = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    spec = LseSpec(i32(cu_q), i32(cu_k), 200, 150, False, 0.25, "varlen")
    with torch.no_grad():
        out, lse = lse_forward(q, k, v, spec)
        dout = _weights(out, 5)
        grads = lse_backward(dout, q, k, v, out, lse, spec)
    assert {b for _, b, _ in _ran()} == {"flash"} and len(_ran()) == 2
    leaves, want, want_lse = _exact(q, k, v, cu_q, cu_k, causal=False)
    torch.testing.assert_close(lse[:, :cu_q[-1]].double(), want_lse[:, :cu_q[-1]], **TOL[torch.float32])
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    for got, exp in zip(grads, torch.autograd.grad((want * dout.double()).sum(), leaves)):
        torch.testing.assert_close(got.double(), exp, **TOL[torch.float32])


def test_varlen_cudnn_is_refused_where_the_torch_does_not_select(monkeypatch):
    from flexsp.runtime.kernels import AttentionError
    hostile.install(monkeypatch.setattr, NAN, DeviceFacts("cpu", (9, 0), varlen=True, kernel_dtypes=hostile.FLOATS,
                                                          cudnn=91900))
    q, k, v = _qkv(16, 4, 2, torch.bfloat16)
    with pytest.raises(AttentionError, match="selects its backend by sdpa_kernel"):
        attend(q, k, v, (0, 9, 13), backend="varlen_cudnn")
    assert attend(q, k, v, (0, 9, 13), backend="auto").shape == q.shape    # auto: Flash's varlen


def test_the_report_names_the_kernels_that_ran(monkeypatch):
    from flexsp.runtime.kernels import ran
    hostile.install(monkeypatch.setattr, NAN, selecting=True)
    q, k, v = _qkv(300, 4, 2, torch.bfloat16)
    bounds = (0, 200, 290)
    out, fwd = ran.kernels_in(lambda: attend(q, k, v, bounds, max_seqlen=200, bounds=bounds))
    _, bwd = ran.kernels_in(lambda: torch.autograd.grad(out.sum(), (q, k, v)))
    assert fwd == {"forward": ["cudnn"], "backward": []} and bwd == {"forward": [], "backward": ["cudnn"]}
    assert ran.describe(ran.merged(fwd, bwd)) == "forward cudnn, backward cudnn"
    q, k, v = _qkv(20, 4, 2, torch.float32)
    _, both = ran.kernels_in(lambda: torch.autograd.grad(attend(q, k, v, (0, 20), backend="sdpa").sum(), (q, k, v)))
    assert both == {"forward": ["sdpa flash (cpu)"], "backward": ["sdpa flash (cpu)"]}


# --- a planned step on gloo ranks, the stand-ins in every rank ------------------------------------
WORLD = 4
LENGTHS = [9, 6, 11, 5, 7, 13, 10, 15, 14, 9, 18, 11]     # no group's tokens divide its degree: every pack pads
VOCAB = 64
CFG = ModelSpec(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48)
STEP_CASES = [(torch.float32, "auto", NAN), (torch.bfloat16, "auto", HUGE), (torch.bfloat16, "flash", NAN),
              (torch.float32, "flash", HUGE)]
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}    # max |g - reference| over max |reference|


def _step_plan() -> Plan:
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=WORLD, predicted_time=0.0, micro_batches=(
        mb(((0,), (0, 1), 1), ((1,), (2,), 1), ((2,), (3,), 1), ((3,), (4,), 1)),     # degree 1
        mb(((0, 1), (5, 6), 1), ((2, 3), (7,), 1)),                                  # degree 2
        mb((range(4), (8, 9), 1)),                                                   # degree 4
        mb((range(4), (10, 11), 2)),                                                 # Ulysses 2 x ring 2
    ))


def _step_batch():
    ids = torch.randint(1, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
    return list(ids.split(LENGTHS))


def _step_model(dtype):
    from flexsp.runtime.models.tiny import TinyLM
    torch.manual_seed(21)
    return TinyLM(CFG).to(dtype)


def _hostile_step_worker(rank, world_size, cases):
    from flexsp.runtime.pool import GroupPool
    from flexsp.runtime.step import StepExecutor
    pool = GroupPool(splits=[(2, 2)])
    out = []
    for dtype, backend, poison in cases:
        hostile.install(setattr, poison)                 # this rank's kernels are the hostile stand-ins
        model = _step_model(dtype)
        executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.0), pool, backend=backend)
        result = executor.run_plan(_step_plan(), _step_batch())
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float()
        out.append({"loss": result.loss, "grads": grads, "degrees": result.degrees,
                    "ops": sorted({c["op"] for c in hostile.Trace.calls})})
    return out


@pytest.fixture(scope="module")
def hostile_steps():
    return run_distributed(_hostile_step_worker, WORLD, STEP_CASES, timeout=120)


def _one_process_grads(dtype):
    model = _step_model(dtype)
    from flexsp.runtime.shard import loss_tokens
    loss = sum(F.cross_entropy(model(s)[:-1].float(), s[1:], reduction="sum") for s in _step_batch())
    (loss / loss_tokens(LENGTHS)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float()


@pytest.mark.parametrize("case", range(len(STEP_CASES)),
                         ids=[f"{str(d).split('.')[-1]}-{b}-{p}" for d, b, p in STEP_CASES])
def test_planned_step_with_hostile_kernels_equals_one_process(hostile_steps, case):
    dtype, backend, _ = STEP_CASES[case]
    want = _one_process_grads(dtype)
    for rank, runs in enumerate(hostile_steps):
        run = runs[case]
        assert run["degrees"] == (1, 2, 4, 4)
        # the stand-ins ran: attend's kernel, and the ring's lse forms (forward and its merged-statistics backward)
        assert {"forward", "backward"} <= set(run["ops"]) and ("flash" in run["ops"]) == (backend == "flash")
        got = torch.as_tensor(run["grads"])
        assert bool(torch.isfinite(got).all()), f"rank {rank}: non-finite gradients"
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= GRAD_TOL[dtype], f"rank {rank}: gradients off by {err:.3g} of their largest entry"


def test_flash_attention_3_stand_in_is_picked_on_hopper_and_its_tuple_unwrapped(monkeypatch):
    """FA3 releases return ``(out, lse)``: ``auto`` on Hopper with FA3 runs it, padding still zero."""
    from flexsp.runtime.kernels import flash as flash_mod
    hostile.install(monkeypatch.setattr, HUGE, DeviceFacts("cpu", (9, 0), (2, 11), varlen=True, flash=3,
                                                           kernel_dtypes=hostile.FLOATS))

    def fa3(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
        out, lse, _ = hostile.hostile_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                             max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                                             return_attn_probs=True)
        return out, lse
    monkeypatch.setattr(flash_mod, "FLASH", flash_mod.FlashAPI(fa3, 3))
    q, k, v = _qkv(12, 4, 1, torch.bfloat16)
    out = attend(q, k, v, (0, 4, 10), backend="auto")
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [c["op"] for c in hostile.Trace.calls] == ["flash"]
    assert _zero_rows(out, 10) and all(_zero_rows(g, 10) for g in grads)
    leaves, want, _ = _exact(q, k, v, (0, 4, 10))
    torch.testing.assert_close(out.double(), want, **TOL[torch.bfloat16])
