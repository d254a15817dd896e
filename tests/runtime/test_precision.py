"""bf16 that trains: fp32 rotary/norm/loss keep a bf16 model's logits near fp32 at positions past 4,096,
and short mixed-precision runs (bf16 compute, fp32 master weights and reduction) track fp32: FSDP2's
policy when sharded, the executor's autocast where nothing is wrapped (world 1, or sharding "none")."""
import pytest

torch = pytest.importorskip("torch")

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec
from flexsp.runtime.fsdp import autocast_dtype, is_sharded, shard_model  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM, rotate  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.shard import pack  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

CFG = ModelSpec(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)
ROTARY_TOL = 0.04    # bf16 rotary output vs fp64, positions 4096-16383 (bf16 rounding of x alone: ~0.016)
LOGIT_TOL = 0.02     # max |bf16 - fp32| logit, positions 4096-4607 (logits have std ~0.1-0.2)
LOSS_TOL = 0.02      # |bf16 - fp32| mean loss per step, relative


def test_rotary_in_bf16_stays_close_past_4096():
    x = torch.randn(16384, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16384)
    want = rotate(x, pos, 10000.0)
    got = rotate(x.to(torch.bfloat16), pos, 10000.0)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want)[4096:].abs().max() < ROTARY_TOL
    # What this guards against: angles and rotation in bf16 (the old code) miss by whole units.
    xb, dim = x.to(torch.bfloat16), 16
    angles = (pos.double()[:, None] * 10000.0 ** (-torch.arange(0, dim, 2).double() / dim)).to(torch.bfloat16)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    old = torch.cat([xb[..., :8] * cos - xb[..., 8:] * sin, xb[..., 8:] * cos + xb[..., :8] * sin], dim=-1)
    assert (old.double() - want)[4096:].abs().max() > 10 * ROTARY_TOL


def test_bf16_logits_match_fp32_past_position_4096():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    half = TinyLM(CFG)
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)   # what FSDP2's bf16 param_dtype computes with
    seqs = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (300, 212)]
    packed = pack(seqs, 1)
    positions = packed.position_ids + 4096   # both sequences sit at positions 4096.. (attention span stays short)
    with torch.no_grad():
        want = model(packed.input_ids, positions, packed.context(backend="sdpa"))
        got = half(packed.input_ids, positions, packed.context(backend="sdpa"))
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max().item()
    assert err < LOGIT_TOL, err
    # The loss is taken in fp32 from bf16 logits: it matches too.
    labels = packed.labels
    with torch.no_grad():
        lw = model.shard_loss(packed.input_ids, positions, labels, packed.context(backend="sdpa"))
        lg = half.shard_loss(packed.input_ids, positions, labels, packed.context(backend="sdpa"))
    assert lg.dtype == torch.float32 and abs(lg.item() - lw.item()) < LOSS_TOL * lw.item()


def _learnable_batch(step):
    """Counting sequences (start, stride vary): a pattern the model learns within a few steps."""
    g = torch.Generator().manual_seed(step)
    lengths = [40, 24, 18, 30]
    return [(torch.randint(0, 64, (1,), generator=g) + (1 + int(torch.randint(0, 3, (1,), generator=g)))
             * torch.arange(n)) % 64 for n in lengths]


PLAN = Plan(num_gpus=2, predicted_time=0.0, micro_batches=(
    MicroBatch((Group(ranks=(0, 1), seq_ids=(0,)),)),
    MicroBatch((Group(ranks=(0,), seq_ids=(1, 2)), Group(ranks=(1,), seq_ids=(3,)))),
))


def _precision_worker(rank, world_size, steps, plan, runs):
    losses = {}
    for name, sharding, dtype in runs:
        torch.manual_seed(0)
        model = shard_model(TinyLM(CFG), sharding=sharding, param_dtype=dtype)
        assert is_sharded(model) == (world_size > 1 and sharding != "none")
        assert autocast_dtype(model) == (None if is_sharded(model) else dtype)
        executor = StepExecutor(model, torch.optim.AdamW(model.parameters(), lr=1e-2), GroupPool(),
                                backend="sdpa", failure_name=name)
        losses[name] = [executor.run_plan(plan, _learnable_batch(s)).loss for s in range(steps)]
        assert all(p.dtype == torch.float32 for p in model.parameters())   # fp32 master weights
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    return losses


def _check_tracks(fp32, mixed):
    assert fp32[-1] < 0.8 * fp32[0]                # it learns
    assert mixed[0] != fp32[0]                     # bf16 really computed something (not the fp32 path)
    for a, b in zip(fp32, mixed):
        assert abs(a - b) <= LOSS_TOL * a, (fp32, mixed)


def test_short_bf16_run_tracks_fp32():
    steps = 12
    runs = run_distributed(_precision_worker, 2, steps, PLAN, (("fp32", "full", None), ("bf16", "full", torch.bfloat16),
                                                              ("bf16 none", "none", torch.bfloat16)))
    assert runs[1] == runs[0]                      # every rank reports the same global loss
    _check_tracks(runs[0]["fp32"], runs[0]["bf16"])          # FSDP2 mixed precision
    _check_tracks(runs[0]["fp32"], runs[0]["bf16 none"])     # unwrapped: autocast, gradients all-reduced


WORLD_ONE = Plan(num_gpus=1, predicted_time=0.0, micro_batches=(
    MicroBatch((Group(ranks=(0,), seq_ids=(0, 3)),)), MicroBatch((Group(ranks=(0,), seq_ids=(1, 2)),))))


def test_world_one_bf16_is_autocast_without_fsdp_and_tracks_fp32():
    (run,) = run_distributed(_precision_worker, 1, 8, WORLD_ONE, (("fp32", "full", None),
                                                                  ("bf16", "full", torch.bfloat16)))
    _check_tracks(run["fp32"], run["bf16"])


# --- the executor's compute dtype (issue 35.4): applied or refused, never silently fp32 -------------------
def _dtype_worker(rank, world_size):
    from flexsp.runtime.config import TrainConfig
    from flexsp.runtime.fsdp import PrecisionError

    def fresh():
        torch.manual_seed(0)
        return TinyLM(CFG)

    def loss(model, **kw):
        executor = StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), GroupPool(), **kw)
        return executor.autocast, executor.run_plan(WORLD_ONE, _learnable_batch(0)).loss

    bf16 = TrainConfig(param_dtype=torch.bfloat16, backend="sdpa")
    out = {"fp32": loss(fresh(), config=TrainConfig(param_dtype=None, backend="sdpa")),
           "unprepared": loss(fresh(), config=bf16),                        # applied by the executor itself
           "setting": loss(fresh(), backend="sdpa", param_dtype=torch.bfloat16),
           "prepared": loss(shard_model(fresh(), bf16), config=bf16)}       # shard_model's world-1 autocast
    refused = {}
    cases = {"prepared for bf16, asked fp32": lambda: (shard_model(fresh(), bf16), TrainConfig(param_dtype=None)),
             "fp64 parameters": lambda: (fresh().double(), bf16),
             "bf16 parameters asked fp32": lambda: (fresh().to(torch.bfloat16), TrainConfig(param_dtype=torch.float32))}
    for name, make in cases.items():
        model, config = make()
        try:
            StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), GroupPool(), config=config)
            refused[name] = None
        except PrecisionError as exc:
            refused[name] = str(exc)
    return out, refused


def test_the_executor_applies_the_configured_compute_dtype_or_refuses():
    (out, refused), = run_distributed(_dtype_worker, 1)
    assert out["fp32"][0] is None
    for way in ("unprepared", "setting", "prepared"):
        dtype, loss = out[way]
        assert dtype == torch.bfloat16, way
        assert loss != out["fp32"][1] and abs(loss - out["fp32"][1]) <= LOSS_TOL * out["fp32"][1], way   # bf16 ran
    assert out["unprepared"][1] == out["prepared"][1]   # the same autocast whichever way in
    assert all(refused.values()), refused
    assert "pass the same TrainConfig" in refused["prepared for bf16, asked fp32"]
