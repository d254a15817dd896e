"""Run a per-sequence operator (a recurrence, a causal convolution) over every sequence of a packed stream.

``by_sequence(fn, tensors, bounds, rows)``: the stream's tensors (time on dim 0) are gathered into one
batch per distinct sequence length (``[n, length, ...]``: no padding inside a batch, so a recurrence or
a convolution starts fresh at each sequence's first token and never reads a neighbour's tokens or the
padding rows); ``fn`` runs each batch and its outputs (``[n, length, ...]``) are scattered back into
``rows`` rows, zero - in value and gradient - everywhere no sequence is. One call of ``fn`` per distinct
length, not per sequence. Local compute only: no communication here.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch

from flexsp.runtime.transfer import host_tensor


def length_buckets(bounds: Sequence[int]) -> dict[int, list[int]]:
    """Sequence start offsets grouped by sequence length (``bounds``: ``[0, end_1, ..., end_n]``)."""
    buckets: dict[int, list[int]] = defaultdict(list)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            buckets[b - a].append(a)
    return dict(buckets)


def by_sequence(fn: Callable[..., Sequence[torch.Tensor]], tensors: Sequence[torch.Tensor], bounds: Sequence[int],
                rows: int) -> list[torch.Tensor]:
    """``fn(*batched)`` over every sequence bounded by ``bounds``; its outputs placed back in ``rows`` rows."""
    device = tensors[0].device
    outs: list[torch.Tensor] | None = None
    for length, starts in length_buckets(bounds).items():
        index = (host_tensor(starts, torch.int64, device).unsqueeze(1) + torch.arange(length, device=device)).reshape(-1)
        got = fn(*(t.index_select(0, index).reshape(len(starts), length, *t.shape[1:]) for t in tensors))
        if outs is None:
            outs = [o.new_zeros((rows, *o.shape[2:])) for o in got]
        outs = [acc.index_copy(0, index, o.reshape(-1, *o.shape[2:]).to(acc.dtype)) for acc, o in zip(outs, got)]
    if outs is None:
        raise ValueError(f"no sequence in bounds {tuple(bounds)[:8]}")
    return outs
