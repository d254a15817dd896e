"""Activation checkpointing in the HF adapter: "selective" (the attention core recomputed in backward)
and "full" (transformers' per-layer checkpointing) keep fewer saved activations than "none" and give
the same loss and gradients (one process, SP degree 1, fp64)."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flexsp.hf import prepare_model  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402

from .models import LENGTHS, batch, build  # noqa: E402


def _step(sp, mode):
    """Loss, gradients and bytes of activations kept for backward (outside checkpointed regions)."""
    sp.set_recompute(mode)
    sp.train()
    sp.zero_grad(set_to_none=True)
    packed = pack(batch(0), 1)
    ctx = AttentionContext.packed(packed.cu_seqlens, backend="sdpa")
    params = {p.untyped_storage().data_ptr() for p in sp.parameters()}
    kept: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, ctx)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in sp.parameters()])
    return float(loss), grads, sum(kept.values())


def test_recompute_keeps_less_and_changes_nothing():
    base = build("llama")
    results = {}
    for mode in ("none", "selective", "full"):
        sp = prepare_model(copy.deepcopy(base), max_seqlen=max(LENGTHS))
        results[mode] = _step(sp, mode)
    loss, grads, kept = results["none"]
    for mode in ("selective", "full"):
        assert results[mode][0] == pytest.approx(loss, rel=1e-12)
        assert float((results[mode][1] - grads).abs().max() / grads.abs().max()) < 1e-10
    assert results["full"][2] < results["selective"][2] < kept, {m: r[2] for m, r in results.items()}


def test_bad_mode_is_named():
    sp = prepare_model(build("llama"), max_seqlen=max(LENGTHS))
    with pytest.raises(ValueError, match="recompute must be one of"):
        sp.set_recompute("sometimes")
