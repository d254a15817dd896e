"""Ulysses x ring groups on 8 gloo ranks equal one process: the attention layer alone (outputs and
q/k/v gradients; one case with v heads narrower than q/k, as latent attention has) and a whole planned step
(loss and updated weights), fp64, 2 kv heads."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import flexsp  # noqa: E402
from flexsp import Group, MicroBatch, Plan, PlanConfig, PlanError, plan_batch  # noqa: E402
from flexsp.plan.specs import ModelSpec
from flexsp.runtime.kernels import attend  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.shard import loss_tokens  # noqa: E402
from flexsp.runtime.sp.attention import sp_attention  # noqa: E402
from flexsp.runtime.shard import group_inputs  # noqa: E402
from flexsp.runtime.sp.zigzag import zigzag_layout  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

SPLITS = [(2, 4), (2, 2), (1, 4)]

# Attention layer: (group ranks, ring, sequence lengths) run side by side; lengths shorter than the ring,
# not divisible by 2*ring, and a single token.
LAYER_GROUPS = [((0, 1, 2, 3), 2, [13, 2, 9]),         # 2 x 2
                ((4, 5, 6, 7), 4, [3, 1, 11])]         # 1 x 4: a pure ring
WIDE_GROUP = ((0, 1, 2, 3, 4, 5, 6, 7), 4, [21, 6, 1, 16])   # 2 x 4


def _kv_heads(name):
    return 1 if name == "wide" else 2        # 1 kv head under Ulysses 2: replicated, as plain Ulysses does


def _v_dim(name):
    return 6 if name == "wide" else 8        # latent attention's v narrower than q/k (DeepSeek-V3: 128 of 192)


def _qkv(lengths, name):
    g = torch.Generator().manual_seed(len(name))
    total, kv, dv = sum(lengths), _kv_heads(name), _v_dim(name)
    return [torch.randn(total, h, dim, generator=g, dtype=torch.float64)
            for h, dim in ((4, 8), (kv, 8), (kv, dv), (4, dv))]                                 # q, k, v, dout


def _layer_worker(rank, world_size):
    pool = GroupPool(splits=SPLITS)
    results = {}
    for name, groups in (("side_by_side", LAYER_GROUPS), ("wide", [WIDE_GROUP])):
        ranks, ring, lengths = next(g for g in groups if rank in g[0])
        q, k, v, dout = _qkv(lengths, name)
        group = Group(ranks=ranks, seq_ids=tuple(range(len(lengths))), ring=ring)
        shard, ctx = group_inputs(group, [torch.zeros(n, dtype=torch.long) for n in lengths], rank, "cpu", pool=pool,
                                  backend="sdpa")
        lay = zigzag_layout(lengths, len(ranks) // ring, ring)
        local = ranks.index(rank)
        order = lay.stream_order()[local * lay.rank_tokens:(local + 1) * lay.rank_tokens]
        rows = torch.from_numpy(np.where(order < 0, 0, order))
        real = torch.from_numpy(order >= 0)[:, None, None]
        mine = [torch.where(real, t[rows], 0.0).requires_grad_() for t in (q, k, v)]
        out = sp_attention(*mine, ctx)
        grads = torch.autograd.grad((out * torch.where(real, dout[rows], 0.0)).sum(), mine)
        results[name] = {"order": order, "out": out.detach(), "grads": grads, "real_tokens": shard.real_tokens}
    return results


def _reference(lengths, name):
    q, k, v, dout = _qkv(lengths, name)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    padded = F.pad(v, (0, 8 - v.shape[-1]))   # one head size for the reference kernel: zero columns out, sliced off
    out = attend(q, k, padded, cu, backend="reference")[..., :v.shape[-1]]
    return out.detach(), torch.autograd.grad((out * dout).sum(), (q, k, v))


def _assemble(runs, name, ranks, total):
    out = np.zeros((total, 4, _v_dim(name)))
    grads = [np.zeros((total, h, dim)) for h, dim in ((4, 8), (_kv_heads(name), 8), (_kv_heads(name), _v_dim(name)))]
    for r in ranks:
        res = runs[r][name]
        keep = res["order"] >= 0
        idx = res["order"][keep]
        out[idx] = res["out"][keep]
        for acc, g in zip(grads, res["grads"]):
            acc[idx] += g[keep]
        assert (res["out"][~keep] == 0).all()                   # padding rows stay zero
    return out, grads


def test_ring_attention_layer_equals_one_process():
    runs = run_distributed(_layer_worker, 8, timeout=60)
    for name, groups in (("side_by_side", LAYER_GROUPS), ("wide", [WIDE_GROUP])):
        for ranks, ring, lengths in groups:
            out, grads = _assemble(runs, name, ranks, sum(lengths))
            want_out, want_grads = _reference(lengths, name)
            np.testing.assert_allclose(out, want_out.numpy(), rtol=1e-10, atol=1e-12)
            for got, want in zip(grads, want_grads):
                np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
            assert sum(runs[r][name]["real_tokens"] for r in ranks) == sum(lengths)


# A whole step: a degree-8 hybrid (2 x 4), a degree-4 hybrid (2 x 2) beside pure Ulysses groups of 2 and 1,
# and a pure ring (1 x 4) beside a degree-4 Ulysses group.
LENGTHS = [23, 3, 17, 9, 1, 12, 7, 30, 5, 2, 14, 6]
VOCAB = 128
CFG = dict(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, tie_embeddings=True)


def _plan():
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=8, predicted_time=0.0, micro_batches=(
        mb((range(8), (0, 1, 2), 4)),
        mb((range(4), (3, 4, 5), 2), ((4, 5), (6,), 1), ((6,), (8,), 1), ((7,), (9,), 1)),
        mb((range(4), (7,), 4), (range(4, 8), (10, 11), 1)),
    ))


def _batch():
    ids = torch.randint(1, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(7))
    return list(ids.split(LENGTHS))


def _model():
    torch.manual_seed(99)
    return TinyLM(ModelSpec(**CFG)).double()


def _cost(heads=2):
    return flexsp.CostModel(alpha1=1e-6, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1e3,
                            alltoall_bandwidth={2: 1e9, 4: 1e9, 8: 1e9}, token_capacity=6, heads=heads, kv_heads=2,
                            ring_bytes_per_token=1e3, ring_bandwidth=1e9, meta={"sharding": "none"})


def _planned():
    """What plan_batch makes of the batch when the cost model knows only 2 heads: 2 x 4 hybrids."""
    cost = _cost()
    return plan_batch(LENGTHS, cost, flexsp.Cluster(num_gpus=8, gpus_per_node=8), time_limit=1.0), cost.ulysses_limit


def _loader_step(pool, limit):
    """One step the way examples/train.py runs it: FlexSPLoader plans (2-head cost model) and shards."""
    import torch.distributed as dist

    from flexsp.data import FlexSPLoader, LoaderConfig
    from flexsp.runtime.sp.context import IGNORE_INDEX
    batch = _batch()
    cost, cluster = _cost(limit), flexsp.Cluster(num_gpus=8, gpus_per_node=8)
    loader = FlexSPLoader([t.tolist() for t in batch], cost, cluster, pool=pool, lengths=LENGTHS,
                          config=LoaderConfig(batch_size=len(LENGTHS), seed=3, lookahead=0, plan=PlanConfig(time_limit=1.0)))
    step = next(iter(loader))
    loader.close()
    model = _model()
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.5), pool, backend="sdpa")
    checked, seen = executor._check_shard, []
    executor._check_shard = lambda *a: seen.append(checked(*a)) or seen[-1]
    executor.step(step)   # the one step path
    # every context the step and the shard hand the layers has the host bounds run_plan's has (the per-sequence
    # kernels need them with device cu_seqlens; the kernel rule reads the length mix from them)
    bounds = []
    for shard, work in zip(step.micro_batches, seen):
        group = step.plan.micro_batches[shard.micro_batch].group_of_rank(pool.rank)
        _, want = group_inputs(group, [batch[i] for i in shard.indices], pool.rank, "cpu", pool=pool)
        bounds.append((work.ctx.bounds, shard.context().bounds, want.bounds))
    return model, step, bounds


def _step_worker(rank, world_size, plan, planned, limit):
    pool = GroupPool(splits=[(1, 4)], ulysses_limit=limit)     # (1, 4) plus the planner's (2, 2) and (2, 4)
    model = _model()
    executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.5), pool, backend="sdpa")
    result = executor.run_plan(Plan.from_dict(plan), _batch())
    planned_model = _model()
    StepExecutor(planned_model, torch.optim.SGD(planned_model.parameters(), lr=0.5), pool,
                 backend="sdpa").run_plan(Plan.from_dict(planned), _batch())
    loaded_model, loaded, loaded_bounds = _loader_step(pool, limit)
    errors = []
    for bad in ({"ring": 8, "ranks": range(8)}, {"ring": 2, "ranks": range(2)}):   # 1 x 8 and 1 x 2: not pooled
        p = Plan(num_gpus=8, predicted_time=0.0, micro_batches=(MicroBatch((
            Group(ranks=tuple(bad["ranks"]), seq_ids=tuple(range(len(LENGTHS))), ring=bad["ring"]),)),))
        try:
            executor.run_plan(p, _batch())
        except PlanError as exc:
            errors.append(str(exc))
    vector = lambda m: torch.nn.utils.parameters_to_vector(m.parameters()).detach()  # noqa: E731
    return {"params": vector(model), "planned_params": vector(planned_model), "result": result,
            "loader_params": vector(loaded_model), "loader_indices": loaded.indices,
            "loader_rings": sorted({g.ring for mb in loaded.plan.micro_batches for g in mb.groups}),
            "loader_bounds": loaded_bounds,
            "stats": pool.stats, "splits": pool.splits, "errors": errors}


def test_hybrid_plan_step_equals_one_process():
    plan, (planned, limit) = _plan(), _planned()
    assert {g.ring for mb in planned.micro_batches for g in mb.groups} - {1}      # the planner made hybrids
    runs = run_distributed(_step_worker, 8, plan.to_dict(), planned.to_dict(), limit, timeout=90)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = _batch()
    loss = sum(F.cross_entropy(model(s)[:-1], s[1:], reduction="sum") for s in batch if s.numel() > 1)
    loss = loss / loss_tokens(LENGTHS)
    loss.backward()
    opt.step()
    want = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    for run in runs:
        assert abs(run["params"] - want).max() < 1e-10
        assert abs(run["planned_params"] - want).max() < 1e-10
        assert sorted(run["loader_indices"]) == list(range(len(LENGTHS)))   # the loader's batch is this batch
        assert abs(run["loader_params"] - want).max() < 1e-10
        assert run["loader_rings"][-1] > 1                                     # and its plan had ring groups
        assert run["loader_bounds"] and all(step == shard == want is not None for step, shard, want in run["loader_bounds"])
        assert run["splits"] == ((1, 4), (2, 2), (2, 4))
        assert run["result"].loss == pytest.approx(loss.item(), rel=1e-12)
    assert sum(r["result"].tokens_processed for r in runs) == sum(LENGTHS)   # every token once
    assert runs[0]["result"].degrees == (8, 4, 4) and runs[6]["result"].degrees == (8, 1, 4)
    # Pool: plain blocks 4 + 2 + 1, Ulysses halves already pooled, rings of 2x4 (2) and 2x2 (4), 1x4 reuses blocks.
    assert runs[0]["stats"].count == 13
    assert [r["stats"].per_rank for r in runs] == [5] * 8       # 3 blocks + one 2x2 ring + one 2x4 ring
    for run in runs:
        assert "runs 1 x 8 (Ulysses x ring) but the pool holds the splits" in run["errors"][0]
        assert "runs 1 x 2" in run["errors"][1]
