"""4 gloo ranks, a heterogeneous plan: every HF architecture's loss and gradients equal the
unmodified HF model's on the same packed batch in one process (fp64 weights; tolerance below)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.distributed import run_distributed  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.runtime import GroupPool, StepExecutor  # noqa: E402

from .driver import run_step  # noqa: E402
from .models import ARCHS, LENGTHS, batch, build, reference  # noqa: E402

# Relative error of the loss and of the gradient vector (max-norm), fp64 weights. Measured: <= 6e-16
# for every architecture but Gemma (5e-9: its RMSNorm normalises in fp32 even for fp64 weights, so
# attention's fp64 summation-order noise comes out at fp32 rounding).
RTOL = 1e-7


def _plan(*micro_batches):
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=tuple(
        MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in mb)) for mb in micro_batches))


# Several micro-batches; degrees 4, 2 and 1 side by side; rank 3 idles in the second; 29, 33 and 17
# tokens split over 4 or 2 ranks (not divisible: padded shards).
PLAN = _plan([((0, 1, 2, 3), (1, 3))],
             [((0, 1), (0, 4, 5)), ((2,), (6,))],
             [((0,), (7,)), ((1,), (8,)), ((2, 3), (2, 9))])


def _worker(rank, world_size, states, plan_dict):
    from flexsp.hf import prepare_model
    pool = GroupPool()
    plan, sequences = Plan.from_dict(plan_dict), batch(0)
    out = {}
    for arch, state in states.items():
        sp = prepare_model(build(arch, state), max_seqlen=max(LENGTHS), chunk_tokens=5)
        grads, loss = run_step(sp, plan, sequences, pool)
        out[arch] = {"grads": grads, "loss": loss}
    # The same HF model through the runtime's one planned step (StepExecutor calls shard_loss): one SGD step.
    sp = prepare_model(build("llama", states["llama"]), max_seqlen=max(LENGTHS))
    executor = StepExecutor(sp, torch.optim.SGD(sp.parameters(), lr=0.5), pool, backend="sdpa")
    result = executor.run_plan(plan, sequences)
    out["executor"] = {"loss": result.loss, "degrees": result.degrees,
                       "params": torch.nn.utils.parameters_to_vector(sp.parameters()).detach()}
    out["fsdp"] = _fsdp_step(rank, world_size, states["gemma"], pool)
    return out


# One micro-batch in which every rank has one group, so every rank runs one forward/backward (FSDP2's
# all-gathers and reduce-scatters span the world; idle ranks are the sharded executor's business).
PLAN_FSDP = _plan([((0, 1), (0, 1, 2)), ((2,), (3, 4, 5)), ((3,), (6, 7, 8, 9))])


def _fsdp_step(rank, world_size, state, pool):
    """Gemma (tied head, MQA) with fully_shard per fsdp_units() then the root, as prepare_model(shard=True)
    will do through the sharded runtime: gradients are reduce-scattered shards of the same gradient."""
    from torch.distributed.fsdp import fully_shard

    from flexsp.hf import prepare_model
    sp = prepare_model(build("gemma", state), max_seqlen=max(LENGTHS), chunk_tokens=5)
    for unit in sp.fsdp_units():
        fully_shard(unit)
    fully_shard(sp)
    grads, loss = run_step(sp, Plan.from_dict(PLAN_FSDP.to_dict()), batch(0), pool, reduce=False)
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in sp.parameters()]) * world_size   # FSDP2 averages
    return {"grads": full, "loss": loss, "sharded": all(type(p).__name__ == "DTensor" for p in sp.parameters())}


def _rel(a, b):
    return float(abs(a - b).max() / abs(b).max())


@pytest.fixture(scope="module")
def runs():
    states = {arch: build(arch).state_dict() for arch in ARCHS}
    return states, run_distributed(_worker, 4, states, PLAN.to_dict(), timeout=150)


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_gradients_equal_unmodified_hf(runs, arch):
    states, results = runs
    want_loss, want_grads = reference(build(arch, states[arch]), batch(0))
    for res in results:
        assert res[arch]["loss"] == pytest.approx(want_loss, rel=RTOL)
        assert _rel(torch.as_tensor(res[arch]["grads"]), want_grads) < RTOL
    assert float(want_grads.abs().max()) > 0


def test_step_executor_runs_the_hf_adapter(runs):
    states, results = runs
    model = build("llama", states["llama"])
    want_loss, grads = reference(model, batch(0))
    want = torch.nn.utils.parameters_to_vector(model.parameters()).detach() - 0.5 * grads
    for res in results:
        assert res["executor"]["loss"] == pytest.approx(want_loss, rel=RTOL)
        assert _rel(torch.as_tensor(res["executor"]["params"]), want) < RTOL
    assert [r["executor"]["degrees"] for r in results] == [(4, 2, 1), (4, 2, 1), (4, 1, 2), (4, None, 2)]



def test_fully_sharded_states(runs):
    """fully_shard per decoder layer of the HF model: the same loss and gradient as unmodified HF."""
    states, results = runs
    want_loss, want_grads = reference(build("gemma", states["gemma"]), batch(0))
    for res in results:
        assert res["fsdp"]["sharded"]
        assert res["fsdp"]["loss"] == pytest.approx(want_loss, rel=RTOL)
        assert _rel(torch.as_tensor(res["fsdp"]["grads"]), want_grads) < RTOL
