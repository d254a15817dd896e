"""Measure the activation bytes one token keeps per decoder layer: what the capacity model must match.

``saved_bytes(model, tokens)`` runs ``model.hidden_states`` (``TinyLM`` and the HF adapter both have it) on
one causal sequence under ``torch.autograd.graph.saved_tensors_hooks`` and sums the bytes of the distinct
storages autograd saves for backward (a view and its base count once). ``bytes_per_token_layer`` takes the
double difference over two layer counts and two token counts, so what does not grow with both (the
embedding, the LM head, autocast's bf16 weight copies, the rotary table every layer shares) drops out:
what is left is one layer's activations per token, the figure ``flexsp.plan.memory`` models.

Precision (``PRECISIONS``): ``"autocast"`` is the executor's world-1 / unsharded path (fp32 parameters, the
forward under ``torch.autocast(bf16)``); ``"bf16"`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``
(every parameter cast to bf16, so the residual stream is bf16 too); ``"fp32"`` computes in fp32.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from flexsp.runtime.sp.context import AttentionContext

PRECISIONS = ("autocast", "bf16", "fp32")


def saved_bytes(model: nn.Module, tokens: int, precision: str = "autocast", *, seed: int = 0) -> int:
    """Bytes of the distinct storages autograd saves in ``model.hidden_states`` on ``tokens`` tokens."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    device = next(model.parameters()).device
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else None
    vocab = vocab or _embedding(model).num_embeddings
    ids = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    positions = torch.arange(tokens, device=device)
    ctx = AttentionContext.single(tokens, device=device)
    cast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "autocast" else nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        out = model.hidden_states(ids, positions, ctx)
    del out
    return sum(storages.values())


def bytes_per_token_layer(build: Callable[[int], nn.Module], precision: str = "autocast", recompute: str = "none",
                          *, layers: tuple[int, int] = (1, 2), tokens: tuple[int, int] = (128, 256)) -> float:
    """Activation bytes one token keeps in one layer: ``build(n)`` makes an ``n``-layer model (fp32), which
    is cast to bf16 for ``precision="bf16"`` and set to ``recompute``; double difference of ``saved_bytes``."""
    grid = {}
    for n in layers:
        model = build(n)
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        model.set_recompute(recompute)
        for t in tokens:
            grid[n, t] = saved_bytes(model, t, precision)
    (n0, n1), (t0, t1) = layers, tokens
    return (grid[n1, t1] - grid[n0, t1] - grid[n1, t0] + grid[n0, t0]) / ((n1 - n0) * (t1 - t0))


def _embedding(model: nn.Module) -> nn.Embedding:
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))
