"""The HF adapter at world 1 with bf16 compute: no FSDP2 wrapping (``prepare_model(shard=...)`` records the
dtype, the executor autocasts the forward), fp32 master weights and gradients, loss close to fp32's."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.distributed import run_distributed  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.runtime import GroupPool, StepExecutor  # noqa: E402

from .models import LENGTHS, batch, build  # noqa: E402

LOSS_TOL = 0.02   # |bf16 - fp32| loss per step, relative (the runtime's precision test uses the same)
PLAN = Plan(num_gpus=1, predicted_time=0.0,
            micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=tuple(range(len(LENGTHS)))),)),))


def _worker(rank, world_size):
    from torch.distributed.fsdp import FSDPModule

    from flexsp.hf import prepare_model
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        sp = prepare_model(build("llama").float(), max_seqlen=max(LENGTHS), chunk_tokens=16,
                           shard={"param_dtype": dtype})
        assert not any(isinstance(m, FSDPModule) for m in sp.modules())
        executor = StepExecutor(sp, torch.optim.AdamW(sp.parameters(), lr=1e-2), GroupPool(), failure_name=name)
        out[name] = [executor.run_plan(PLAN, batch(s)).loss for s in range(3)]
        assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
                   for p in sp.parameters())
    return out


def test_world_one_bf16_adapter_runs_under_autocast_and_tracks_fp32():
    (got,) = run_distributed(_worker, 1)
    assert got["bf16"][0] != got["fp32"][0]          # the forward really ran in bf16
    for a, b in zip(got["fp32"], got["bf16"]):
        assert abs(a - b) <= LOSS_TOL * a, got
