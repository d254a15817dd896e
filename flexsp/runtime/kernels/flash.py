"""flash-attn's varlen kernel (optional: GPU machines with flash-attn built), generation 3 or 2.

FlashAttention-3 (Hopper) installs as ``flash_attn_interface``, FlashAttention-2 as ``flash_attn``; both
take ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., softmax_scale=, causal=)``
and read kv head ``h // (heads / kv_heads)`` themselves. FA3 releases differ in whether they also return
the lse: the first element of a tuple is the output. Raw: rows outside ``cu_seqlens`` are unspecified
(``padding.py`` makes them zero). The lse forms the ring needs use ``varlen_attn`` (whose backward takes
merged statistics through a stable op) or the per-sequence kernels, never flash-attn's private backward.

Layer features are read from the signature (``FlashAPI.of``), never assumed from a version number:
``window_size=(left, right)`` (FA2 >= 2.3, FA3), ``softcap=`` (FA2 >= 2.6, FA3) and a learnable sink
(``learnable_sink=``, FA4's ``flash_attn.cute``-style interfaces; absent: ``sinks.py``'s lse correction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import inspect

import torch

SINK_ARGS = ("learnable_sink",)   # the parameter names a flash-attn release takes per-head sink logits by


@dataclass(frozen=True)
class FlashAPI:
    """The installed flash-attn varlen function, its generation (2 or 3) and the layer features it takes."""

    fn: Callable[..., Any]
    generation: int
    window: bool = False           # takes ``window_size=(left, right)``
    softcap: bool = False          # takes ``softcap=``
    sink: str | None = None        # the name of its per-head sink argument, if any

    @classmethod
    def of(cls, fn: Callable[..., Any], generation: int) -> "FlashAPI":
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        sink = next((name for name in SINK_ARGS if name in params), None)
        return cls(fn, generation, window="window_size" in params, softcap="softcap" in params, sink=sink)


def installed() -> FlashAPI | None:
    """FA3 if importable, else FA2, else None (absent, or a build that does not match the installed torch)."""
    try:
        from flash_attn_interface import flash_attn_varlen_func as fa3
        return FlashAPI.of(fa3, 3)
    except Exception:
        pass
    try:
        from flash_attn import flash_attn_varlen_func as fa2
        return FlashAPI.of(fa2, 2)
    except Exception:
        return None


FLASH: FlashAPI | None = installed()   # read once at import


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
            scale: float, *, window: int | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal flash-attn over the packed stream; differentiable through flash-attn's own backward.
    ``window``/``softcap``/``sinks`` only where ``FLASH`` takes them (the caller checks ``supports``)."""
    kwargs: dict[str, Any] = {}
    if window is not None:
        kwargs["window_size"] = (window - 1, 0)
    if softcap is not None:
        kwargs["softcap"] = softcap
    if sinks is not None:
        kwargs[FLASH.sink] = sinks
    out = FLASH.fn(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def supports(api: FlashAPI | None, window: bool, softcap: bool, sinks: bool) -> bool:
    """``api`` computes a layer with these features in its own call."""
    return api is not None and (api.window or not window) and (api.softcap or not softcap) and \
        (api.sink is not None or not sinks)
