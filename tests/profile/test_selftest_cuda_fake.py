"""``flexsp selftest``'s CUDA branch without a GPU (issue 35.3): what it builds, expects and reports.

* Under ``FakeTensorMode`` with fake CUDA tensors: the default shape is a Llama-3-8B layer shape with two
  layers, its vocabulary cut only where the (faked) device memory needs it; the model is built on the
  device and prepared by ``shard_model`` for bf16 (the executor autocasts it); the kernel path for its
  bf16 heads is ``varlen``. A CPU-only torch cannot run random in-place init (``uniform_``) on fake CUDA
  tensors, so ``nn.Linear``'s default init is skipped there (``TinyLM`` re-initialises every weight anyway).
* On the CPU, with ``torch.cuda``'s allocator statistics and sync-debug switch stubbed: the memory row
  counts the same states on both sides (parameters and AdamW moments measured = the capacity model's
  master + optimizer bytes), and a synchronising call inside the step is reported with its flexsp call site.
"""
import dataclasses
import types

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from flexsp.cli import main  # noqa: E402
from flexsp.plan.memory import activation_bytes_per_token, state_bytes  # noqa: E402
from flexsp.plan.specs import get_model  # noqa: E402
from flexsp.profile import selftest as st  # noqa: E402
from flexsp.profile import selftest_model as sm  # noqa: E402
from flexsp.runtime.fsdp import runtime_sharding, step_autocast  # noqa: E402
from flexsp.runtime.kernels import resolve_backend  # noqa: E402

CUDA = torch.device("cuda", 0)
GIB = 2**30
LLAMA = dataclasses.replace(get_model("llama3-8b"), layers=2)


def test_the_default_cuda_shape_is_a_two_layer_llama3_8b_with_its_full_vocabulary_on_an_80gb_gpu():
    setup = st.plan_model(torch, CUDA, None, None, None, 80 * GIB)
    spec = setup["spec"]
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == \
        (2, 4096, 32, 8, 14336, 128256)
    assert setup["half"] and setup["vocab_note"] == "" and sum(setup["lengths"]) == pytest.approx(sm.CUDA_TOKENS, abs=4)
    # the capacity model's accounting at world 1: 18 bytes per parameter (fp32 master, grads, Adam, bf16 copy)
    need = setup["budget"]
    assert need.states.total == state_bytes(spec.params, 1, "full").total == 18 * spec.params
    assert need.activations == activation_bytes_per_token(spec, "none", "autocast") * sum(setup["lengths"])
    # the forward's own states: bf16 copies of the layers' weights (not the embedding or the head) and the
    # head's fp32 gradient the fused loss makes during the forward
    head = 4096 * 128256
    assert need.forward_states == 2 * (spec.params - 2 * head) + 4 * head


def _forwards(spec, tokens, scale, head_grad_bytes=4):
    """Allocator figures of one micro-batch whose forward keeps ``scale`` x the modelled activations, its
    head gradient made at ``head_grad_bytes`` per element (4: FlexSP's fp32 loss, 2: liger-kernel's bf16)."""
    need = sm.budget(spec, tokens, half=True, head_grad_bytes=head_grad_bytes)
    before = 5 * GIB
    return need, {0: [tokens, before, before + need.forward_states + scale * need.activation_per_token * tokens]}


@pytest.mark.parametrize("scale,status", [(1.0, st.PASS), (1.1, st.PASS), (0.9, st.PASS), (1.3, st.FAIL),
                                          (0.7, st.FAIL)])
def test_the_memory_check_compares_activations_with_activations(scale, status):
    """An activation regression (30% more saved than the capacity model counts) fails, states apart."""
    need, forwards = _forwards(LLAMA, 8192, scale)
    marks = {"other": GIB, "peak": GIB + need.states.total}
    row = st.memory_row(LLAMA, 8192, marks, forwards, 8 * GIB)
    assert row["status"] == status, row["detail"] if "detail" in row else row
    assert row["relative_error"] == pytest.approx(scale - 1)


@pytest.mark.parametrize("kept,assumed,status", [(2, 2, st.PASS), (4, 4, st.PASS), (2, 4, st.FAIL)])
def test_the_head_gradient_is_counted_at_the_loss_kernels_size(kept, assumed, status):
    """liger-kernel's forward keeps the head's gradient in bf16, FlexSP's own loss in fp32: counted at the
    wrong size, the head's 1 GiB at vocab 128,256 reads as 22% fewer activations (GPU run 2, an H200)."""
    need, forwards = _forwards(LLAMA, 8192, 1.0, head_grad_bytes=kept)
    marks = {"other": GIB, "peak": GIB + need.states.total}
    row = st.memory_row(LLAMA, 8192, marks, forwards, 8 * GIB, head_grad_bytes=assumed)
    assert row["status"] == status, row


def test_the_memory_check_still_bounds_the_peak():
    need, forwards = _forwards(LLAMA, 8192, 1.0)
    marks = {"other": 0, "peak": need.total + 9 * GIB}
    assert st.memory_row(LLAMA, 8192, marks, forwards, 8 * GIB)["status"] == st.FAIL


def test_a_smaller_gpu_cuts_the_vocabulary_and_says_so():
    setup = st.plan_model(torch, CUDA, None, None, None, 24 * GIB)
    spec, note = setup["spec"], setup["vocab_note"]
    assert spec.vocab < 128256 and spec.vocab % 128 == 0 and (spec.hidden, spec.layers) == (4096, 2)
    assert f"vocabulary cut from 128256 to {spec.vocab}" in note
    lengths = setup["lengths"]
    assert sm.selftest_bytes(spec, sum(lengths), max(lengths), True) <= sm.DEVICE_SHARE * 24 * GIB
    bigger = dataclasses.replace(spec, vocab=spec.vocab + 128)   # the largest that fits
    assert sm.selftest_bytes(bigger, sum(lengths), max(lengths), True) > sm.DEVICE_SHARE * 24 * GIB
    with pytest.raises(sm.SelftestError, match="pick a smaller --shape or --tokens"):
        st.plan_model(torch, CUDA, None, None, None, 4 * GIB)


def test_shapes_by_name_and_fields():
    assert sm.resolve_spec("llama3-8b,layers=2") == dataclasses.replace(LLAMA, name=sm.resolve_spec(
        "llama3-8b,layers=2").name)
    spec = sm.resolve_spec("hidden=64,layers=1,heads=2,kv_heads=1,ffn=128,vocab=256")
    assert (spec.hidden, spec.heads, spec.vocab) == (64, 2, 256)
    for bad, match in (("layers=2,llama3-8b", "name may only come first"), ("llama3-8b,width=3", "unknown field"),
                       ("llama3-8b,layers=x", "whole number"), ("hidden=64", "needs layers")):
        with pytest.raises(sm.SelftestError, match=match):
            sm.resolve_spec(bad)
    with pytest.raises(sm.SelftestError, match="only layers=N applies"):
        sm.parse_shape("llama3-8b", hf=True)


@pytest.fixture
def no_linear_init(monkeypatch):
    for name in ("kaiming_uniform_", "uniform_"):
        monkeypatch.setattr(torch.nn.init, name, lambda t, *a, **k: t)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")   # torch's deepcopy of fakes
def test_the_model_is_built_on_the_gpu_prepared_for_bf16_and_runs_the_varlen_path(no_linear_init):
    setup = st.plan_model(torch, CUDA, None, None, None, 80 * GIB)
    with FakeTensorMode(allow_non_fake_inputs=True), st.world_of_one():
        built = sm.build(torch, setup["spec"], CUDA, half=True)
        params = list(built.flex.parameters())
        assert {(p.device, p.dtype) for p in params} == {(CUDA, torch.float32)}   # fp32 master weights
        norms = (2 * setup["spec"].layers + 1) * setup["spec"].hidden            # ModelSpec.params leaves norms out
        assert sum(p.numel() for p in params) == setup["spec"].params + norms
        assert runtime_sharding(built.flex) == "full"
        assert step_autocast(built.flex, torch.bfloat16, True) == torch.bfloat16  # the executor's compute dtype
        q = torch.empty(8, setup["spec"].heads, setup["spec"].head_size, dtype=torch.bfloat16, device=CUDA)
        kernel = resolve_backend("auto", q)
    if kernel != "varlen":
        pytest.skip(f"this torch has no varlen_attn we know (auto -> {kernel})")
    bounds, rows = st.kernel_batch(setup["spec"], True)
    assert rows > bounds[-1] and rows % 64 == 0   # the kernel check has padding rows, as pack leaves them


class _FakeCuda:
    """``torch.cuda`` for ``_memory_and_syncs`` on the CPU: allocator figures from the test, the sync switch
    recorded so a patched call can raise as CUDA's sync debug mode does."""

    def __init__(self, allocated, extra):
        self.allocated, self.extra, self.mode = allocated, extra, 0

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.allocated + self.extra

    def set_sync_debug_mode(self, mode):
        self.mode = mode

    def get_device_properties(self, device):
        return types.SimpleNamespace(total_memory=80 * GIB)

    def reset_peak_memory_stats(self, device): ...
    def synchronize(self, device): ...
    def empty_cache(self): ...


def test_memory_counts_the_same_states_and_a_sync_is_reported_at_its_call_site(monkeypatch):
    import flexsp.runtime.shard as shard
    spec = sm.resolve_spec("hidden=64,layers=1,heads=2,kv_heads=1,ffn=128,vocab=256")
    fake_cuda = _FakeCuda(allocated=3 * GIB, extra=GIB)
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in ("optim", "bfloat16", "float32")}, cuda=fake_cuda)
    real = shard.host_tensor

    def host_tensor(*args, **kwargs):   # what set_sync_debug_mode("error") does to a pageable copy on CUDA
        if fake_cuda.mode == "error":
            raise RuntimeError("called a synchronizing CUDA operation")
        return real(*args, **kwargs)
    monkeypatch.setattr(shard, "host_tensor", host_tensor)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g) for n in (20, 9, 5)]
    from flexsp.plan.types import Group, MicroBatch, Plan
    plan = Plan(num_gpus=1, predicted_time=0.0, micro_batches=(MicroBatch((Group((0,), (0, 1, 2)),)),))
    with st.world_of_one():
        built = sm.build(torch, spec, torch.device("cpu"), half=True)
        memory, syncs = st._memory_and_syncs(shim, torch.device("cpu"), built, plan, batch, 34)
    need = sm.budget(spec, 34, half=True)
    # measured side: peak minus what is not the model's states; the states present at the window's start are
    # the fp32 master and AdamW's two moments: exactly what the capacity model counts for them
    numel = sum(p.numel() for p in built.flex.parameters())
    assert memory["peak_bytes"] - fake_cuda.extra == (4 + 8) * numel
    norms = 3 * spec.hidden   # ModelSpec.params leaves the norm weights out
    assert (4 + 8) * numel == need.states.params + need.states.optimizer + 12 * norms
    assert memory["predicted_bytes"] == need.total and memory["workspace_bytes"] == pytest.approx(8 * GIB)
    assert syncs["status"] == st.FAIL and syncs["site"].startswith("flexsp/runtime/shard.py:")
    assert " in pack " in syncs["site"] and "host_tensor" in syncs["site"]
    assert fake_cuda.mode == 0   # disarmed after the step


def test_another_shape_on_cpu_through_the_cli(tmp_path):
    out = tmp_path / "r.json"
    shape = "hidden=64,layers=1,heads=2,kv_heads=1,ffn=128,vocab=256"
    assert main(["selftest", "--device", "cpu", "--shape", shape, "--tokens", "48", "--repeats", "1",
                 "--output", str(out)]) == 0
    import json
    report = json.loads(out.read_text())
    assert report["model"]["hidden"] == 64 and report["model"]["vocab"] == 256 and report["vocab_note"] == ""
    kernels = report["checks"][0]
    assert kernels["padding_max_abs"] == 0.0 and kernels["status"] == "pass"


class _SyncingLibrary(torch.autograd.Function):
    """liger-kernel's fused linear cross-entropy as it behaves on CUDA: a host sync in forward (``.item()``)
    and one in backward (``torch.equal``), which sync-debug mode "error" turns into a raise."""

    cuda = None

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        _SyncingLibrary.cuda.sync("liger forward .item()")
        ctx.save_for_backward(hidden, weight, labels)
        return torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100, reduction="sum")

    @staticmethod
    def backward(ctx, grad):
        _SyncingLibrary.cuda.sync("liger backward torch.equal")
        hidden, weight, labels = ctx.saved_tensors
        with torch.enable_grad():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = torch.nn.functional.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum")
            gh, gw = torch.autograd.grad(loss * grad, (h, w))
        return gh, gw, None


def _library(input, weight, target, bias=None, ignore_index=-100, reduction="mean", accum_dtype=None):
    assert reduction == "sum" and accum_dtype == torch.float32 and bias is None
    return _SyncingLibrary.apply(input, weight, target)


@pytest.mark.parametrize("planted", [False, True], ids=["library syncs only", "a planted .item() in FlexSP"])
def test_host_sync_check_allows_the_librarys_own_syncs_and_catches_flexsps(monkeypatch, planted):
    import sys

    from flexsp.runtime.models import fused_loss, tiny
    spec = sm.resolve_spec("hidden=64,layers=1,heads=2,kv_heads=1,ffn=128,vocab=256")
    fake_cuda = _FakeCuda(allocated=3 * GIB, extra=GIB)
    syncs = []

    def sync(what):
        syncs.append(what)
        if fake_cuda.mode in ("error", 2):       # set by name, or restored from get_sync_debug_mode's int
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")
    fake_cuda.sync = sync
    fake_cuda.get_sync_debug_mode = lambda: {"error": 2, "warn": 1}.get(fake_cuda.mode, fake_cuda.mode)
    _SyncingLibrary.cuda = fake_cuda
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in ("optim", "bfloat16", "float32")}, cuda=fake_cuda)
    # the library on this CPU, and torch.cuda's sync-debug switch where fused_loss reads it
    monkeypatch.setitem(sys.modules, fused_loss.LIBRARY_MODULE,
                        types.SimpleNamespace(**{fused_loss.LIBRARY_FUNCTION: _library}))
    monkeypatch.setattr(fused_loss, "LIBRARY_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", fake_cuda.get_sync_debug_mode)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", fake_cuda.set_sync_debug_mode)
    if planted:   # FlexSP's own code reads a device value on the host: what .item() does on CUDA
        real_loss = tiny.lm_head_loss

        def loss(*args, **kwargs):
            out = real_loss(*args, **kwargs)
            sync("flexsp .item()")
            return out
        monkeypatch.setattr(tiny, "lm_head_loss", loss)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(1, spec.vocab, (n,), generator=g) for n in (20, 9, 5)]
    from flexsp.plan.types import Group, MicroBatch, Plan
    plan = Plan(num_gpus=1, predicted_time=0.0, micro_batches=(MicroBatch((Group((0,), (0, 1, 2)),)),))
    with st.world_of_one():
        built = sm.build(torch, spec, torch.device("cpu"), half=True)
        _, row = st._memory_and_syncs(shim, torch.device("cpu"), built, plan, batch, 34)
    assert "liger forward .item()" in syncs and "liger backward torch.equal" in syncs   # the library did run
    if planted:
        assert row["status"] == st.FAIL and row["site"].startswith("flexsp/runtime/models/tiny.py:"), row
        assert "flexsp .item()" in row["detail"]
    else:
        assert row["status"] == st.PASS, row["detail"]
    assert fake_cuda.mode == 0
