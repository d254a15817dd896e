"""The adapter's step builds no ``[tokens, tokens]`` tensor: not through transformers' mask builders, not
through any torch op. Every op's output is recorded under a dispatch mode; the same recorder finds the
square mask in the native packed call, so it would catch one in the adapter's."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

from flexsp.hf import prepare_model  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402

from .models import ARCHS, LENGTHS, batch, build, config  # noqa: E402

TOKENS = sum(LENGTHS)   # 85: no model dimension (vocab 128, hidden 32, ffn 48, head_dim 16) equals it


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def square(self, tokens: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(op, s) for op, s in self.shapes if len(s) >= 2 and s[-2:] == (tokens, tokens)]


def _step(sp) -> None:
    packed = pack(batch(0), 1)
    assert packed.input_ids.numel() == TOKENS
    ctx = AttentionContext.packed(packed.cu_seqlens, backend="auto")
    sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, ctx).backward()


@pytest.mark.parametrize("arch", ARCHS)
def test_no_square_tensor_in_the_adapters_step(arch, monkeypatch):
    sp = prepare_model(build(arch), max_seqlen=max(LENGTHS))

    def refuse(*a, **k):
        raise AssertionError("transformers built an attention mask")

    for key in list(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):   # every mask builder, whatever the key
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping, key, refuse)
    with Shapes() as shapes:
        _step(sp)
    assert shapes.shapes, "the recorder saw no op"
    assert shapes.square(TOKENS) == []


def test_the_recorder_finds_the_native_packed_mask():
    """Control: the unwrapped model called on the same pack with position ids builds the [T, T] mask."""
    model = build("llama")
    packed = pack(batch(0), 1)
    with Shapes() as shapes:
        model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False)
    assert shapes.square(TOKENS)


def test_eager_key_builds_no_square_tensor():
    """fp32: the native eager softmax runs in fp32, so an fp64 model would fail the probe's fp64 tolerance."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config("llama"), attn_implementation="eager")
    sp = prepare_model(copy.deepcopy(model), max_seqlen=max(LENGTHS))
    with Shapes() as shapes:
        _step(sp)
    assert shapes.square(TOKENS) == []
