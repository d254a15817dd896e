"""Four gloo processes: shards match the plan, epochs and resumes are exact, slow or failing solvers."""
import json
import time

import pytest
from helpers import cluster, cost_model, token_lists

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from runtime.distributed import run_distributed  # noqa: E402  (the shared helper in tests/runtime/)

import flexsp  # noqa: E402
from flexsp import PlanConfig
from flexsp.data import FlexSPLoader, LoaderConfig  # noqa: E402
from flexsp.plan.specs import ModelSpec
from flexsp.runtime import GroupPool, TinyLM  # noqa: E402
from flexsp.runtime.shard import pack
from flexsp.runtime.sp.context import IGNORE_INDEX

WORLD = 4
NUM_SEQS = 44
CONFIG = LoaderConfig(batch_size=8, seed=5, plan=PlanConfig(time_limit=0.1))     # flexsp strategy, planned on rank 0 only


def _record(steps):
    return [{"key": (s.epoch, s.index), "indices": s.indices, "plan": s.plan.to_dict()["micro_batches"],
             "loss_tokens": s.loss_tokens,
             "shards": [(m.micro_batch, m.ranks, m.input_ids, m.labels, m.position_ids, m.cu_seqlens.tolist(),
                         m.group is None, m.real_tokens) for m in s.micro_batches]} for s in steps]


def _epoch_and_resume_worker(rank, world, cut):
    pool = GroupPool()
    data = token_lists(NUM_SEQS, seed=11)
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG, pool=pool) as loader:
        full = _record(list(loader))
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG, pool=pool) as loader:
        head = []
        for step in loader:
            head.append(step)
            if len(head) == cut:
                break
        state = json.loads(json.dumps(loader.state_dict()))   # as if saved to disk and restarted
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG, pool=pool) as loader:
        loader.load_state_dict(state)
        tail = _record(list(loader))
    return {"full": full, "head": _record(head), "tail": tail, "state": state}


@pytest.fixture(scope="module")
def epoch_runs():
    return run_distributed(_epoch_and_resume_worker, WORLD, 2, timeout=60)


def _check_run(per_rank, data):
    """Every rank got exactly its plan's shards; the groups' shards rebuild the packed global batch."""
    seen = []
    for steps in zip(*per_rank):
        first = steps[0]
        assert all(s["indices"] == first["indices"] and s["plan"] == first["plan"] for s in steps)
        plan = flexsp.Plan.from_dict({"num_gpus": WORLD, "predicted_time": 0, "micro_batches": first["plan"]})
        plan.validate(lengths=[len(data[i]) for i in first["indices"]], cost=None)
        tokens = []
        for r, s in enumerate(steps):
            assert [sh[0] for sh in s["shards"]] == [m for m, mb in enumerate(plan.micro_batches)
                                                    if mb.group_of_rank(r) is not None]
        for m, mb in enumerate(plan.micro_batches):
            for g in mb.groups:
                parts = [next(sh for sh in steps[r]["shards"] if sh[0] == m) for r in g.ranks]
                assert all(p[1] == g.ranks and p[6] == (g.degree == 1) for p in parts)   # pool groups handed out
                whole = pack([torch.tensor(data[first["indices"][s]]) for s in g.seq_ids], g.degree)
                for k, name in ((2, "input_ids"), (3, "labels"), (4, "position_ids")):
                    assert (torch.cat([torch.as_tensor(p[k]) for p in parts]) == getattr(whole, name)).all()
                assert all(p[5] == list(whole.cu_seqlens) for p in parts)
                tokens += whole.input_ids[:whole.real_tokens].tolist()
        # concatenating all ranks' real tokens reproduces the global batch
        assert sorted(tokens) == sorted(t for i in first["indices"] for t in data[i])
        assert first["loss_tokens"] == sum(len(data[i]) - 1 for i in first["indices"])
        seen += first["indices"]
    return seen


def test_every_rank_gets_its_shards_and_an_epoch_uses_each_sequence_once(epoch_runs):
    data = token_lists(NUM_SEQS, seed=11)
    seen = _check_run([r["full"] for r in epoch_runs], data)
    assert sorted(seen) == list(range(NUM_SEQS))
    assert len(epoch_runs[0]["full"]) == -(-NUM_SEQS // CONFIG.batch_size)


def test_resume_gives_the_remaining_batches_of_an_uninterrupted_run(epoch_runs):
    data = token_lists(NUM_SEQS, seed=11)
    assert all(r["state"] == epoch_runs[0]["state"] for r in epoch_runs)
    assert epoch_runs[0]["state"]["index"] == 2
    full = epoch_runs[0]["full"]
    head, tail = epoch_runs[0]["head"], epoch_runs[0]["tail"]
    assert [s["key"] for s in head + tail] == [s["key"] for s in full]
    assert [s["indices"] for s in head + tail] == [s["indices"] for s in full]
    seen = _check_run([r["head"] for r in epoch_runs], data) + _check_run([r["tail"] for r in epoch_runs], data)
    assert sorted(seen) == list(range(NUM_SEQS))    # none lost, none repeated across the restart


# --- slow and failing solvers ---------------------------------------------------------------------

def _slow_greedy(seconds, calls):
    def solve(lengths):
        calls.append(time.perf_counter())
        time.sleep(seconds)
        return flexsp.plan_batch(lengths, cost_model(), cluster(), strategy="greedy")
    return solve


def _train_with_slow_solver_worker(rank, world, solve_s, step_s, steps):
    pool = GroupPool()
    torch.manual_seed(0)
    model = TinyLM(ModelSpec(vocab=1000, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, tie_embeddings=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    config = LoaderConfig(batch_size=6, seed=1, lookahead=2)
    losses, waits = [], []
    with FlexSPLoader(token_lists(60, seed=3), cost_model(), cluster(), config, pool=pool,
                      planner=_slow_greedy(solve_s, calls)) as loader:
        for step in loader:
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for mb in step.micro_batches:
                logits = model(mb.input_ids, mb.position_ids, mb.context("sdpa"))
                loss = F.cross_entropy(logits, mb.labels, ignore_index=IGNORE_INDEX, reduction="sum") / step.loss_tokens
                loss.backward()
                total += loss.detach()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              for p in model.parameters()] + [total.reshape(1)])
            dist.all_reduce(flat)
            opt.step()
            time.sleep(step_s)   # the rest of a step's compute
            losses.append(float(flat[-1]))
            waits.append(step.plan_wait)
            if len(losses) == steps:
                break
        return {"losses": losses, "waits": waits, "max_ahead": loader.stats.max_ahead, "solves": len(calls)}


def test_slow_solver_is_hidden_behind_training_and_lookahead_holds():
    solve_s, step_s = 0.2, 0.4
    out = run_distributed(_train_with_slow_solver_worker, WORLD, solve_s, step_s, 5, timeout=60)
    assert all(o["losses"] == out[0]["losses"] for o in out)      # one global loss, every rank
    # 5 steps, the 6th being prepared ahead (prefetch), and the planner's look-ahead of 2 beyond it
    assert out[0]["max_ahead"] <= 2 and out[0]["solves"] <= 5 + 1 + 2
    for o in out:
        assert max(o["waits"][1:]) < 0.5 * solve_s, o["waits"]   # after the first, no step waits for a solve


def _failing_solver_worker(rank, world):
    pool = GroupPool()
    calls = []

    def fails_on_third(lengths):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("solver blew up on purpose")
        return flexsp.plan_batch(lengths, cost_model(), cluster(), strategy="greedy")

    with FlexSPLoader(token_lists(40, seed=2), cost_model(), cluster(), LoaderConfig(batch_size=5), pool=pool,
                      planner=fails_on_third) as loader:
        for _ in loader:
            pass


def test_solver_exception_raises_on_every_rank_and_processes_exit():
    outcomes = run_distributed(_failing_solver_worker, WORLD, timeout=60, expect_errors=True)
    for o in outcomes:
        assert o.error_type == "LoaderError", o
        assert "planning global batch 2 of epoch 0 failed on rank 0: RuntimeError: solver blew up on purpose" in o.error
        assert o.exitcode == 1


def _bad_state_worker(rank, world):
    from flexsp.data import LoaderError
    config = LoaderConfig(batch_size=8, seed=2, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(token_lists(30, high=100), cost_model(), cluster(world), config, pool=GroupPool()) as loader:
        try:
            loader.load_state_dict({**loader.state_dict(), "index": 99})   # only the planning rank can tell
        except LoaderError as exc:
            return str(exc)
        return "accepted"


def test_a_state_only_the_planning_rank_can_refuse_is_refused_on_every_rank():
    """The planning rank checks a state's position against its epoch and its dataset digest; the others cannot.
    Its verdict is agreed: every rank raises the same error (they went on alone and timed out in the first step)."""
    out = run_distributed(_bad_state_worker, 2, timeout=60)
    assert len(set(out)) == 1 and "index 99 is past epoch 0's" in out[0]
