"""An unprepared model's gradients are summed over the world in buckets (one collective per bucket):
with buckets small enough that some hold several parameters, one holds a parameter alone, and dtypes
split them, every gradient is the exact sum of the ranks' gradients."""
import pytest

torch = pytest.importorskip("torch")

from .distributed import run_distributed  # noqa: E402


def _worker(rank, world_size):
    from torch import nn

    import flexsp.runtime.step as step
    step.BUCKET_BYTES = 64 * 4            # 64 fp32 values: several small parameters share, the 40x10 goes alone
    model = nn.Sequential(nn.Linear(10, 40), nn.Linear(40, 3), nn.Linear(3, 3))
    model[2].double()                     # another dtype: its own bucket
    model.add_module("unused", nn.Linear(2, 2))   # no gradient on any rank: joins with zeros
    for i, p in enumerate(model.parameters()):
        if i < 6:
            p.grad = torch.full_like(p, float(rank + 1)) * (torch.arange(p.numel(), dtype=p.dtype).view_as(p) + i)
    step._allreduce_grads(model)
    return [p.grad.tolist() for p in model.parameters()]


def test_bucketed_sum_equals_the_sum_of_every_ranks_gradient():
    results = run_distributed(_worker, 2, timeout=60)
    want_scale = 1 + 2                    # rank r contributes (r + 1) x the same pattern
    for res in results:
        grads = res
        assert len(grads) == 8
        for i, g in enumerate(grads[:6]):
            flat = torch.tensor(g).reshape(-1)
            assert torch.equal(flat, want_scale * (torch.arange(flat.numel(), dtype=flat.dtype) + i))
        assert all(torch.tensor(g).abs().sum() == 0 for g in grads[6:])
