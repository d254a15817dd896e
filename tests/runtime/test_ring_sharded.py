"""Ulysses x ring groups under FSDP2-sharded states: the one planned step equals one process (fp64)."""
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec
from flexsp.runtime import GroupPool, StepExecutor, TinyLM, loss_tokens, shard_model  # noqa: E402

from .distributed import run_distributed  # noqa: E402

LENGTHS = [23, 3, 17, 9, 1, 12, 7, 30, 5, 2, 14, 6]
CFG = dict(vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, tie_embeddings=True)


def _plan() -> Plan:
    """2 x 4 and 2 x 2 hybrids, a pure ring (1 x 4) and plain Ulysses groups; rank 7 idles in the last."""
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=8, predicted_time=0.0, micro_batches=(
        mb((range(8), (0, 1, 2), 4)),
        mb((range(4), (3, 4, 5), 2), ((4, 5), (6,), 1), ((6,), (8,), 1), ((7,), (9,), 1)),
        mb((range(4), (7,), 4), ((4, 5), (10, 11), 1)),
    ))


def _batch():
    ids = torch.randint(1, CFG["vocab"], (sum(LENGTHS),), generator=torch.Generator().manual_seed(7))
    return list(ids.split(LENGTHS))


def _model():
    torch.manual_seed(99)
    return TinyLM(ModelSpec(**CFG)).double()


def _worker(rank, world_size, plan):
    pool = GroupPool(splits=[(2, 4), (2, 2), (1, 4)])
    model = _model()
    shard_model(model, sharding="full", param_dtype=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with StepExecutor(model, optimizer, pool, backend="sdpa") as executor:
        result = executor.run_plan(Plan.from_dict(plan), _batch())
    full = [p.full_tensor() for p in model.parameters()]   # all-gathers the FSDP2 shards
    return {"params": torch.cat([p.reshape(-1) for p in full]), "loss": result.loss, "degrees": result.degrees}


def test_ring_groups_under_fsdp2_equal_one_process():
    runs = run_distributed(_worker, 8, _plan().to_dict(), timeout=120)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = sum(F.cross_entropy(model(s)[:-1], s[1:], reduction="sum") for s in _batch() if s.numel() > 1)
    loss = loss / loss_tokens(LENGTHS)
    loss.backward()
    optimizer.step()
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    for run in runs:
        assert abs(run["params"] - want).max() < 1e-10
        assert run["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert runs[7]["degrees"] == (8, 1, None)     # the idle rank still joined every FSDP collective
