"""``torch.nn.attention.varlen.varlen_attn`` across torch releases: detect the signature once, call it one way.

torch changed the public call between 2.10 and 2.12 (``is_causal`` became ``window_size=(-1, 0)``;
``scale`` and ``enable_gqa`` appeared) and the backward op grew ``scale`` and ``window_size``. A call
pinned to one release breaks on the next, so ``VarlenAPI.detect`` reads the parameter names (the
public function's signature, the backward op's schema) and ``forward``/``backward`` build the call
the installed torch accepts. What is missing is made up for here: no ``scale`` -> q is pre-scaled;
no ``enable_gqa`` -> kv heads are repeated (and their gradients summed back). A signature with
neither ``is_causal`` nor ``window_size`` is not one we know: ``detect`` returns None and ``auto``
never picks ``varlen``. The lse is always returned as ``[heads, tokens]`` float32.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class VarlenAPI:
    """What the installed ``varlen_attn`` accepts (names read from its signature)."""

    fn: Callable[..., Any]
    causal_arg: str                       # "window_size" (torch >= 2.12) or "is_causal" (2.10, 2.11)
    aux: Any                              # AuxRequest class, or None when lse comes from ``return_lse=True``
    scale: bool                           # accepts ``scale=``
    gqa: bool                             # accepts ``enable_gqa=``
    backward_op: Callable[..., Any] | None
    backward_args: tuple[str, ...]        # the backward op's argument names, in order

    @classmethod
    def detect(cls, fn: Callable[..., Any] | None, aux: Any = None,
               backward_op: Callable[..., Any] | None = None) -> "VarlenAPI | None":
        if fn is None:
            return None
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return None
        causal = "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else None
        if causal is None or not ("return_aux" in params or "return_lse" in params):
            return None
        names: tuple[str, ...] = ()
        if backward_op is not None:
            schema = getattr(getattr(backward_op, "default", backward_op), "_schema", None)
            if schema is not None:
                names = tuple(a.name for a in schema.arguments)
            else:
                try:
                    names = tuple(inspect.signature(backward_op).parameters)
                except (TypeError, ValueError):
                    names = ()
        return cls(fn=fn, causal_arg=causal, aux=aux if "return_aux" in params else None,
                   scale="scale" in params, gqa="enable_gqa" in params,
                   backward_op=backward_op if names else None, backward_args=names)

    # --- calls --------------------------------------------------------------------------------
    def _prepare(self, q, k, v, scale: float):
        """(q, k, v) as this API takes them: kv heads repeated without ``enable_gqa``, q pre-scaled without ``scale``."""
        group = q.shape[1] // k.shape[1]
        if group > 1 and not self.gqa:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        factor = scale * math.sqrt(q.shape[2])
        if not self.scale and factor != 1.0:
            q = q * factor
        return q, k, v, group, factor

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float,
                lse: bool = False):
        """``out`` (and ``lse [heads, tokens_q]`` float32 with ``lse=True``); differentiable through ``out``."""
        q, k, v, group, _ = self._prepare(q, k, v, scale)
        kwargs: dict[str, Any] = {}
        if self.causal_arg == "window_size":
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        if self.scale:
            kwargs["scale"] = scale
        if self.gqa and group > 1:
            kwargs["enable_gqa"] = True
        if lse:
            if self.aux is not None:
                kwargs["return_aux"] = self.aux(lse=True)
            else:
                kwargs["return_lse"] = True
        result = self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
        if not lse:
            return result
        out, stat = result
        if stat.shape != (q.shape[1], q.shape[0]):   # older releases: [tokens, heads]
            stat = stat.transpose(0, 1)
        return out, stat.float()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
        """``(dq, dk, dv)`` from the softmax statistics ``out``/``lse`` (FA2's convention: empty rows +inf)."""
        if self.backward_op is None:
            raise RuntimeError("this torch's varlen_attn has no backward op we can call")
        kv_heads = k.shape[1]
        qp, kp, vp, group, factor = self._prepare(q, k, v, scale)
        values = {"grad_out": dout, "query": qp, "key": kp, "value": vp, "out": out, "lse": lse,
                  "cu_seq_q": cu_q, "cu_seq_k": cu_k, "max_q": max_q, "max_k": max_k, "is_causal": causal,
                  "rng_state": torch.zeros(2, dtype=torch.uint64, device=q.device), "scale": scale,
                  "window_size": [-1, 0] if causal else [-1, -1]}
        args = [values[name] for name in self.backward_args if name in values]
        dq, dk, dv = self.backward_op(*args)
        if not self.scale and factor != 1.0:
            dq = dq * factor
        if dk.shape[1] != kv_heads:   # repeated kv heads: sum the copies' gradients back
            dk = dk.unflatten(1, (kv_heads, group)).sum(2)
            dv = dv.unflatten(1, (kv_heads, group)).sum(2)
        return dq, dk, dv


def installed() -> VarlenAPI | None:
    """The installed torch's varlen API, or None (no ``torch.nn.attention.varlen``, or an unknown signature)."""
    try:
        from torch.nn.attention import varlen as mod
    except Exception:
        return None
    op = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn_backward", None)
    try:
        return VarlenAPI.detect(getattr(mod, "varlen_attn", None), getattr(mod, "AuxRequest", None), op)
    except Exception:
        return None
