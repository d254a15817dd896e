"""Degree 1 pays for nothing it does not need: no FSDP wrapping at world 1 (whatever the TrainConfig), no exchange or all-to-all for a single-rank group, rotary cos/sin once per micro-batch, and
Python calls per layer within 2x of the plain per-sequence loop - while the step stays exact."""
import sys

import pytest

torch = pytest.importorskip("torch")

import flexsp.runtime.models.tiny as tiny  # noqa: E402
import flexsp.runtime.sp.context as context_mod  # noqa: E402
import flexsp.runtime.sp.ulysses_comm as comm  # noqa: E402
from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.config import TrainConfig  # noqa: E402
from flexsp.runtime.fsdp import autocast_dtype, runtime_sharding, shard_model  # noqa: E402
from flexsp.runtime.models.plain import plain_loss  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

LENGTHS = [40, 24, 8, 8, 15]


def _model(layers=2, dtype=torch.float64):
    torch.manual_seed(7)
    return TinyLM(ModelSpec(vocab=64, hidden=32, layers=layers, heads=4, kv_heads=2, ffn=64)).to(dtype)


def _batch():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 64, (n,), generator=g) for n in LENGTHS]


def _plan():
    return Plan(num_gpus=1, predicted_time=0.0,
                micro_batches=(MicroBatch((Group(ranks=(0,), seq_ids=tuple(range(len(LENGTHS)))),)),))


def test_degree_one_step_equals_the_plain_loop_step():
    flex, plain = _model(), _model()
    executor = StepExecutor(flex, torch.optim.SGD(flex.parameters(), lr=0.5), GroupPool())
    result = executor.run_plan(_plan(), _batch())
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    loss = plain_loss(plain, _batch())
    loss.backward()
    opt.step()
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    for a, b in zip(flex.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_degree_one_makes_no_exchange_and_one_rotary_table_per_micro_batch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("degree 1 touched the all-to-all")
    monkeypatch.setattr(comm._AllToAll, "apply", refuse)
    monkeypatch.setattr(context_mod.AttentionContext, "trades", property(refuse))
    tables = []
    real = tiny.Rotary.__init__
    monkeypatch.setattr(tiny.Rotary, "__init__", lambda self, *a, **k: (tables.append(1), real(self, *a, **k))[1])
    model = _model(layers=3)
    StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), GroupPool()).run_plan(_plan(), _batch())
    assert len(tables) == 1                      # one micro-batch, three layers, q and k: one table


def _calls(fn) -> int:
    """Python-level calls (functions and builtins) ``fn`` makes."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _per_layer(run) -> float:
    counts = {}
    for layers in (2, 4):
        model = _model(layers, torch.float32)
        run(model)                                    # warm caches (first-call imports, dispatch setup)
        counts[layers] = _calls(lambda: run(model))
    return (counts[4] - counts[2]) / 2


def test_python_calls_per_layer_within_twice_the_plain_loop():
    batch, plan = _batch(), _plan()

    def flex(model):
        model.zero_grad(set_to_none=True)
        executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.0), GroupPool())
        executor._forward_backward([executor._pack(batch, None, plan.micro_batches[0].groups[0])], 100)

    def plain(model):
        model.zero_grad(set_to_none=True)
        plain_loss(model, batch).backward()
    ours, theirs = _per_layer(flex), _per_layer(plain)
    assert 0 < ours <= 2 * theirs, (ours, theirs)


def _wrapping(rank, world_size):
    from torch.distributed.fsdp import FSDPModule
    out = {}
    for sharding in ("full", "grad_optim", "none"):
        for dtype in (None, torch.float32, torch.bfloat16):
            model = shard_model(_model(dtype=torch.float32), TrainConfig(sharding=sharding, param_dtype=dtype))
            fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
            out[sharding, dtype] = (fsdp, runtime_sharding(model), autocast_dtype(model),
                                    {p.dtype for p in model.parameters()})
    return out


def test_no_fsdp_wrapping_at_world_one_for_any_config():
    (got,) = run_distributed(_wrapping, 1)
    for (sharding, dtype), (fsdp, recorded, autocast, dtypes) in got.items():
        assert not fsdp and recorded == sharding and dtypes == {torch.float32}, (sharding, dtype)
        # mixed precision without FSDP2: the executor's autocast (fp32 asked of an fp32 model: none)
        assert autocast == (torch.bfloat16 if dtype == torch.bfloat16 else None), (sharding, dtype)
