"""A Hugging Face model under a plan with Ulysses x ring groups (2 kv heads, 8 gloo ranks) takes the
same SGD step as the unmodified model on the whole packed batch in one process (fp64)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.distributed import run_distributed  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.runtime import GroupPool, StepExecutor  # noqa: E402

from .models import batch, build, reference  # noqa: E402

LR = 0.5


def _plan() -> Plan:
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=8, predicted_time=0.0, micro_batches=(
        mb((range(8), (0, 1, 2), 4)),                                                     # 2 x 4
        mb((range(4), (3, 4, 5), 2), ((4, 5), (6,), 1), ((6,), (7,), 1), ((7,), (8,), 1)),   # 2 x 2 beside Ulysses
        mb((range(4), (9,), 4)),                                                          # pure ring; 4..7 idle
    ))


def _worker(rank, world_size, state, plan):
    from flexsp.hf import prepare_model
    sp = prepare_model(build("llama", state), max_seqlen=64)
    pool = GroupPool(splits=[(2, 4), (2, 2), (1, 4)])
    with StepExecutor(sp, torch.optim.SGD(sp.parameters(), lr=LR), pool, backend="sdpa") as executor:
        result = executor.run_plan(Plan.from_dict(plan), batch(0))
    return {"params": torch.nn.utils.parameters_to_vector(sp.parameters()).detach(), "loss": result.loss}


def test_hf_model_with_ring_groups_equals_unmodified_model():
    model = build("llama")   # tiny llama: 4 heads, 2 kv heads -> Ulysses limit 2, larger groups need the ring
    assert model.config.num_key_value_heads == 2
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runs = run_distributed(_worker, 8, state, _plan().to_dict(), timeout=180)
    loss, grads = reference(model, batch(0))
    want = (torch.nn.utils.parameters_to_vector(model.parameters()).detach() - LR * grads).numpy()
    for run in runs:
        assert run["loss"] == pytest.approx(loss, rel=1e-10)
        assert abs(run["params"] - want).max() < 1e-10
