"""A planned step on 4 ranks updates the model exactly as one device on the whole batch would: FSDP2-sharded
(full, grad_optim, none) or not, from a plan + batch or from the loader's Step, SGD and AdamW in fp64."""
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexsp import Group, MicroBatch, Plan, PlanError  # noqa: E402
from flexsp.plan.specs import ModelSpec
from flexsp.runtime.fsdp import shard_model  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.shard import loss_tokens
from flexsp.runtime.sp.context import PAD_TOKEN
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

LENGTHS = [9, 17, 5, 12, 3, 7, 11, 2, 6, 13]            # 85 tokens; every token id is unique
VOCAB = 96
CFG = dict(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)


def _plan(*micro_batches):
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=tuple(
        MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in mb)) for mb in micro_batches))


# Several micro-batches, degrees 1/2/4 side by side, idle ranks, token counts not divisible by degrees.
PLAN_A = _plan([((0, 1, 2, 3), (1, 3))],
               [((0, 1), (0, 4, 5)), ((2,), (6,))],                       # rank 3 idles
               [((0,), (7,)), ((1,), (8,)), ((2, 3), (2, 9))])
PLAN_B = _plan([((2, 3), (0, 1, 2)), ((0, 1), (3,))],
               [((1,), (4,))],                                             # ranks 0, 2, 3 idle
               [((0, 1, 2, 3), (5, 6, 7, 8, 9))])


def _batch(seed):
    ids = torch.randperm(sum(LENGTHS), generator=torch.Generator().manual_seed(seed)) + 1   # 0 is padding
    return list(ids.split(LENGTHS))


def _optimizer(name, params):
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _model(tie):
    torch.manual_seed(1234)
    return TinyLM(ModelSpec(**CFG, tie_embeddings=tie)).double()


def _full_params(model):
    """Every parameter as one vector, gathered from the FSDP shards where the model is sharded."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def _train(plans, tie, opt_name, sharding, name):
    model = _model(tie)
    if sharding != "plain":
        shard_model(model, sharding=sharding, param_dtype=None)   # fp64 compute, fp64 reduction
    seen = []   # every token id this rank pushed through the model
    model.embed.register_forward_hook(lambda mod, args, out: seen.extend(args[0].tolist()))
    executor = StepExecutor(model, _optimizer(opt_name, model.parameters()), GroupPool(), backend="sdpa",
                            failure_name=name)
    results = [executor.run_plan(Plan.from_dict(p), _batch(step)) for step, p in enumerate(plans)]
    return {"params": _full_params(model), "results": results, "seen": seen}


def _train_worker(rank, world_size, plans, tie, opt_name, shardings=("full",), other_plans=None):
    """``plans`` for the first sharding, ``other_plans`` (default the same) for the rest."""
    return {s: _train(plans if i == 0 or other_plans is None else other_plans, tie, opt_name, s, f"train-{s}")
            for i, s in enumerate(shardings)}


def _reference(plans, tie, opt_name):
    """One device, the whole global batch, no packing: mean next-token loss, one optimizer step each."""
    model = _model(tie)
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for step in range(len(plans)):
        batch = _batch(step)
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(seq)[:-1], seq[1:], reduction="sum") for seq in batch) / loss_tokens(LENGTHS)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), losses


@pytest.fixture(scope="module")
def plan_a_run():
    plans = [PLAN_A.to_dict()]
    return plans, [r["full"] for r in run_distributed(_train_worker, 4, plans, True, "sgd")]


def _assert_matches_reference(plans, runs, tie, opt_name):
    want, losses = _reference(plans, tie, opt_name)
    for run in runs:
        assert abs(want - run["params"]).max() < 1e-10
        assert [r.loss for r in run["results"]] == pytest.approx(losses, rel=1e-12)
    assert abs(want - _reference([], tie, opt_name)[0]).max() > 1e-4   # the step really moved the model


def test_heterogeneous_step_equals_single_device_step(plan_a_run):
    plans, runs = plan_a_run
    _assert_matches_reference(plans, runs, True, "sgd")
    assert [r["results"][0].degrees for r in runs] == [(4, 2, 1), (4, 2, 1), (4, 1, 2), (4, None, 2)]


def test_two_steps_two_plans_untied_adamw_every_sharding():
    """FSDP2 full shard, gradients+optimizer only, replicated (HSDP 4x1), and an unprepared model."""
    plans = [PLAN_B.to_dict(), PLAN_A.to_dict()]
    shardings = ("full", "grad_optim", "none", "plain")
    runs = run_distributed(_train_worker, 4, plans, False, "adamw", shardings, plans[:1])
    for s in shardings:
        _assert_matches_reference(plans if s == "full" else plans[:1], [r[s] for r in runs], False, "adamw")
    assert runs[2]["full"]["results"][0].degrees == (2, None, 4)


def test_no_sequence_dropped_or_duplicated(plan_a_run):
    _, runs = plan_a_run
    batch = _batch(0)
    # Each rank holds ceil(T/d) tokens of its group, the last ones padding; count the real ones.
    expected = [0, 0, 0, 0]
    for mb in PLAN_A.micro_batches:
        for g in mb.groups:
            total = sum(LENGTHS[s] for s in g.seq_ids)
            shard = -(-total // g.degree)
            for i, r in enumerate(g.ranks):
                expected[r] += max(0, min(shard, total - i * shard))
    assert [r["results"][0].tokens_processed for r in runs] == expected
    assert sum(expected) == sum(LENGTHS)
    # The token ids the ranks embedded: every real token exactly once over the world.
    real = sorted(t for run in runs for t in run["seen"] if t != PAD_TOKEN)
    assert real == sorted(torch.cat(batch).tolist())
    assert {r["results"][0].loss_tokens for r in runs} == {loss_tokens(LENGTHS)}


def _bad_plan_worker(rank, world_size):
    pool = GroupPool()
    only_1_and_4 = GroupPool(degrees=(1, 4))
    model = _model(True)
    batch = _batch(0)
    two_heads = TinyLM(ModelSpec(**{**CFG, "heads": 2, "kv_heads": 1})).double()
    ok = _plan([((0, 1, 2, 3), tuple(range(10)))])
    cases = [
        (pool, model, _plan([((0, 1), (0, 1, 2)), ((4,), (3, 4, 5, 6, 7, 8, 9))]), r"rank 4 is outside 0\.\.3"),
        (pool, model, _plan([((0, 1, 2, 3), (0, 1, 2, 3, 4, 5, 6, 7, 8, 12))]),
         r"sequence ids \[12\] but the batch has 10 sequences"),
        (pool, model, _plan([((0, 1, 2, 3), tuple(range(9)))]), r"sequences \[9\] are not planned"),
        (pool, model, Plan(num_gpus=2, predicted_time=0.0, micro_batches=ok.micro_batches),
         r"plan is for 2 GPUs but the process group has 4 ranks"),
        (pool, model, _plan([((1, 2), tuple(range(10)))]), r"ranks \[1, 2\] are not a tile of degree 2"),
        (only_1_and_4, model, _plan([((0, 1), tuple(range(10)))]), r"ranks \[0, 1\] is not in the pool"),
        (pool, two_heads, ok, r"degree 4 does not divide the 2 attention heads.*\[1, 2\]"),
        (pool, model, Plan(num_gpus=4, predicted_time=0.0, micro_batches=(MicroBatch((
            Group(ranks=(0, 1, 2, 3), seq_ids=tuple(range(10)), ring=2),)),)),
         r"runs 2 x 2 \(Ulysses x ring\) but the pool holds the splits none"),
    ]
    calls = []
    real = dist.all_to_all_single   # the step's first collective (Ulysses); the agreement flag is allowed
    dist.all_to_all_single = lambda *a, **k: calls.append("all_to_all_single")
    try:
        messages = []
        for i, (p, m, plan, pattern) in enumerate(cases):
            executor = StepExecutor(m, torch.optim.SGD(m.parameters(), lr=0.1), p, failure_name=f"bad-{i}")
            with pytest.raises(PlanError, match=pattern) as info:
                executor.run_plan(plan, batch)
            messages.append(str(info.value))
        # Only rank 3 gets a bad plan: every rank raises rank 3's error, naming it.
        plan = _plan([((0, 1, 2, 3), tuple(range(9)) + (12,))]) if rank == 3 else ok
        executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, failure_name="bad-one")
        with pytest.raises(PlanError, match=r"^rank 3: plan references sequence ids \[12\]") as info:
            executor.run_plan(plan, batch)
        messages.append(str(info.value))
    finally:
        dist.all_to_all_single = real
    # Nobody entered a step collective, so the world is still in step: a good plan runs right after.
    StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, failure_name="good").run_plan(ok, batch)
    return {"collectives": calls, "messages": messages}


def test_bad_plans_fail_before_any_collective():
    results = run_distributed(_bad_plan_worker, 4)
    for res in results:
        assert res["collectives"] == []
        assert len(res["messages"]) == 9
    assert len({tuple(r["messages"]) for r in results}) == 1   # every rank says the same


def _uncaught_worker(rank, world_size):
    pool = GroupPool()
    model = _model(True)
    plan = _plan([((0, 1, 2, 3), tuple(range(9)) + (10,))])   # sequence 10 does not exist
    StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool).run_plan(plan, _batch(0))


def test_bad_plan_error_ends_every_process():
    start = time.monotonic()
    outcomes = run_distributed(_uncaught_worker, 4, timeout=60, expect_errors=True)
    assert time.monotonic() - start < 30   # raised, not waited out a collective timeout
    for o in outcomes:
        assert o.error_type == "PlanError" and "sequence ids [10]" in o.error
        assert o.exitcode == 1
