"""A layer's attention features beyond "causal within each packed sequence": ``Features``.

Modern models add to the causal mask per layer (the model says which layer has which; ``flexsp.hf`` reads
it once and passes it down):

* ``window`` - a left window of ``W`` keys including the query itself: query at position ``p`` sees keys
  ``p - W < k <= p`` (transformers' ``sliding_window``; flash-attn's ``window_size=(W - 1, 0)``);
* ``chunk`` - chunked local attention: the query sees only keys of its own ``chunk``-token block
  (``p // C == k // C``; Llama 4's ``attention_chunk_size``);
* ``softcap`` - scores become ``softcap * tanh(score / softcap)`` before the mask (Gemma 2).

Positions are within the query's sequence (they restart at every packed sequence). Attention sinks are a
tensor, not a static feature: ``sinks.py``. ``Features`` is hashable and built once per layer, never per call.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from flexsp.runtime.kernels.layout import AttentionError


@dataclass(frozen=True)
class Features:
    """What one attention layer adds to the causal mask; the default is plain causal attention."""

    window: int | None = None     # left window in keys, the query included; None: unbounded
    chunk: int | None = None      # chunked attention block size in tokens; None: no chunking
    softcap: float | None = None  # score soft cap; None: none

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise AttentionError(f"attention {name} must be a positive whole number of tokens, got {value!r}")
        if self.softcap is not None and not float(self.softcap) > 0:
            raise AttentionError(f"attention softcap must be positive, got {self.softcap!r}")

    @property
    def plain(self) -> bool:
        return self.window is None and self.chunk is None and self.softcap is None

    @property
    def positional(self) -> bool:
        """The mask depends on positions, not just on causality (window or chunk)."""
        return self.window is not None or self.chunk is not None

    def seen(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        """``[lq, lk]`` bool: query at ``pos_q[i]`` sees key at ``pos_k[j]`` (same sequence assumed)."""
        pq, pk = pos_q[:, None], pos_k[None, :]
        allowed = pk <= pq
        if self.window is not None:
            allowed = allowed & (pq - pk < self.window)
        if self.chunk is not None:
            allowed = allowed & (torch.div(pq, self.chunk, rounding_mode="floor")
                                 == torch.div(pk, self.chunk, rounding_mode="floor"))
        return allowed

    def cap(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(capped scores, d capped / d scores)``; the derivative is None without a softcap."""
        if self.softcap is None:
            return scores, None
        t = torch.tanh(scores / self.softcap)
        return t * self.softcap, 1 - t * t

    def unreachable(self, min_q: np.ndarray, max_k: np.ndarray) -> bool:
        """For every sequence ``s``, no query at position ``>= min_q[s]`` sees a key at position ``<= max_k[s]``:
        the whole block is masked out (the ring skips it)."""
        far = np.zeros(np.shape(min_q), dtype=bool)
        if self.window is not None:
            far |= np.asarray(min_q) - np.asarray(max_k) >= self.window
        if self.chunk is not None:
            far |= np.asarray(min_q) // self.chunk > np.asarray(max_k) // self.chunk
        return bool(far.all())


PLAIN = Features()


@functools.lru_cache(maxsize=64)
def chunked_bounds(bounds: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """``bounds`` with every sequence cut at each ``chunk`` tokens from its start: chunked causal attention
    is plain causal attention over the pieces, so every kernel computes it exactly. Cached: every layer of
    a micro-batch asks with the context's same bounds tuple."""
    out = [bounds[0]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.extend(range(a + chunk, b, chunk))
        out.append(b)
    return tuple(out)

