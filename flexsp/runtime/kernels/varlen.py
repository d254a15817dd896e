"""torch's ``varlen_attn`` (one launch for the whole packed stream): the API across releases, ``attend``'s
call, its cuDNN variant, and the log-sum-exp forms the ring uses.

torch changed the public call between 2.10 and 2.12 (``is_causal`` became ``window_size=(-1, 0)``;
``scale`` and ``enable_gqa`` appeared) and the backward op grew ``scale`` and ``window_size``. A call
pinned to one release breaks on the next, so ``VarlenAPI.detect`` reads the parameter names (the
public function's signature, the backward op's schema) and ``forward``/``backward`` build the call
the installed torch accepts. What is missing is made up for here: no ``scale`` -> q is pre-scaled;
no ``enable_gqa`` -> kv heads are repeated (and their gradients summed back). A signature with
neither ``is_causal`` nor ``window_size`` is not one we know: ``detect`` returns None and ``auto``
never picks ``varlen``. The lse is always returned as ``[heads, tokens]`` float32.

Which backend runs inside ``varlen_attn`` is read from what the installed torch offers, not its version:
``selects`` - the module has a backend selection that follows ``sdpa_kernel`` (``_select_backend``;
pytorch PR 193631) or the backward op takes the forward's ``backend`` - and, where it does, every call
runs under an explicit ``sdpa_kernel`` choice: Flash alone for ``varlen`` (else eligible cuDNN would be
taken silently), cuDNN *with Flash enabled* for ``varlen_cudnn``, and only where cuDNN's constraints
hold (``cudnn_fits``: max_q > 128, one cu_seqlens tensor for q and k when causal, fp16/bf16, head dim a
multiple of 8 up to 128; kv heads are repeated for it, as its branch takes no GQA). A call that does not
fit - the executor's one-token idle micro-batch, short micro-batches, the ring's causal blocks with their
own bounds - runs Flash. The backward gets the forward's backend (the op's ``backend`` argument where
its schema has one; torch's ``_select_backend``, asked under the same choice, where it exists). Older
releases (no selection: 2.10-2.13, whose ``_should_use_cudnn`` returns False) run Flash whatever is asked.
torch 2.14 takes cuDNN by itself (``_can_use_cudnn``: sm90/sm100, cuDNN >= 9.18, max_q > 128, no GQA, window
``(-1, -1)``, so never a causal call) with no selection to ask for Flash, and cuDNN's statistics need not have
Flash's layout: there a non-causal call gets a window covering every key (``VarlenAPI.window``), which is the
same attention and keeps Flash, in the forward and in the backward op (which decides again by the same rule).

Everything here is raw: rows outside ``cu_seqlens`` are unspecified (``padding.py`` makes them zero).
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from flexsp.runtime.kernels.layout import LseSpec


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
    select: Callable[..., Any] | None = None   # torch's own backend selection (``_select_backend``), if any
    auto_cudnn: bool = False              # takes eligible cuDNN by itself, with no way to ask for Flash (2.14)

    @property
    def selects(self) -> bool:
        """``varlen_attn`` picks its backend by ``sdpa_kernel`` (and the backward takes the forward's)."""
        return self.select is not None or "backend" in self.backward_args

    @classmethod
    def detect(cls, fn: Callable[..., Any] | None, aux: Any = None,
               backward_op: Callable[..., Any] | None = None,
               select: Callable[..., Any] | None = None, auto_cudnn: bool = False) -> "VarlenAPI | None":
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
                   backward_op=backward_op if names else None, backward_args=names, select=select,
                   auto_cudnn=auto_cudnn)

    # --- calls --------------------------------------------------------------------------------
    def _prepare(self, q, k, v, scale: float, repeat_kv: bool):
        """(q, k, v) as this API takes them: kv heads repeated without ``enable_gqa`` (or when asked),
        q pre-scaled without ``scale``."""
        group = q.shape[1] // k.shape[1]
        if group > 1 and (repeat_kv or not self.gqa):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        factor = scale * math.sqrt(q.shape[2])
        if not self.scale and factor != 1.0:
            q = q * factor
        return q, k, v, group, factor

    def window(self, causal: bool, window: int | None, max_q: int, max_k: int) -> tuple[int, int]:
        """The ``window_size`` of a call. A non-causal, windowless call on a torch that takes cuDNN by itself
        (``auto_cudnn``: only at ``(-1, -1)``, forward and backward op alike) gets a window covering every key
        instead: the same attention, held to Flash, whose statistics layout the lse forms and the backward
        they feed assume."""
        if self.auto_cudnn and not self.selects and not causal and window is None:
            cover = max(max_q, max_k, 1)
            return (cover, cover)
        return _window(causal, window)

    def takes_window(self, backward: bool) -> bool:
        """A left window can be passed (``window_size``), to the backward op too when ``backward``."""
        return self.causal_arg == "window_size" and (not backward or "window_size" in self.backward_args)

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float,
                lse: bool = False, repeat_kv: bool = False, window: int | None = None):
        """``out`` (and ``lse [heads, tokens_q]`` float32 with ``lse=True``); differentiable through ``out``.
        ``window``: keys ``p - window < key <= p`` (only where ``takes_window``)."""
        q, k, v, group, _ = self._prepare(q, k, v, scale, repeat_kv)
        kwargs: dict[str, Any] = {}
        if self.causal_arg == "window_size":
            kwargs["window_size"] = self.window(causal, window, max_q, max_k)
        else:
            kwargs["is_causal"] = causal
        if self.scale:
            kwargs["scale"] = scale
        if self.gqa and k.shape[1] != q.shape[1]:
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

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float,
                 repeat_kv: bool = False, window: int | None = None, backend: str = "flash"):
        """``(dq, dk, dv)`` from the softmax statistics ``out``/``lse`` (FA2's convention: empty rows +inf);
        ``backend``: the forward's ("flash" or "cudnn"), passed where the op takes it."""
        if self.backward_op is None:
            raise RuntimeError("this torch's varlen_attn has no backward op we can call")
        kv_heads = k.shape[1]
        qp, kp, vp, group, factor = self._prepare(q, k, v, scale, repeat_kv)
        values = {"grad_out": dout, "query": qp, "key": kp, "value": vp, "out": out, "lse": lse,
                  "cu_seq_q": cu_q, "cu_seq_k": cu_k, "max_q": max_q, "max_k": max_k, "is_causal": causal,
                  "rng_state": torch.zeros(2, dtype=torch.uint64, device=q.device), "scale": scale,
                  "window_size": list(self.window(causal, window, max_q, max_k)), "backend": backend_value(backend)}
        args = [values[name] for name in self.backward_args if name in values]
        dq, dk, dv = self.backward_op(*args)
        if not self.scale and factor != 1.0:
            dq = dq * factor
        if dk.shape[1] != kv_heads:   # repeated kv heads: sum the copies' gradients back
            dk = dk.unflatten(1, (kv_heads, group)).sum(2)
            dv = dv.unflatten(1, (kv_heads, group)).sum(2)
        return dq, dk, dv


def _window(causal: bool, window: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: -1 unbounded; a window of ``W`` keys is ``(W - 1, 0)``."""
    if window is not None:
        return (window - 1, 0)
    return (-1, 0) if causal else (-1, -1)


def backend_value(name: str) -> int:
    """The backward op's ``backend`` argument: ``SDPBackend``'s value (custom ops take no enums)."""
    from torch.nn.attention import SDPBackend
    return (SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION).value


def _select_names(select: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """torch's ``_select_backend`` if it takes the arguments we pass, by name; else None."""
    try:
        params = inspect.signature(select).parameters if select is not None else {}
    except (TypeError, ValueError):
        return None
    known = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "window_size")
    return select if all(n in params for n in known) else None


def installed() -> VarlenAPI | None:
    """The installed torch's varlen API, or None (no ``torch.nn.attention.varlen``, or an unknown signature)."""
    try:
        from torch.nn.attention import varlen as mod
    except Exception:
        return None
    op = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn_backward", None)
    try:
        return VarlenAPI.detect(getattr(mod, "varlen_attn", None), getattr(mod, "AuxRequest", None), op,
                                _select_names(getattr(mod, "_select_backend", None)),
                                auto_cudnn=callable(getattr(mod, "_can_use_cudnn", None)))
    except Exception:
        return None


_UNREAD = object()


def api() -> VarlenAPI | None:
    """``installed()``, read on first use and kept as the module's ``VARLEN`` (None on a torch without a known
    ``varlen_attn``). Not at import: ``torch.nn.attention.varlen`` imports ``torch._dynamo``, about 1.3 s of
    every process's start on CPU runs that never call it. Tests replace ``VARLEN`` to stand in for other releases."""
    found = globals().get("VARLEN", _UNREAD)
    if found is _UNREAD:
        found = globals()["VARLEN"] = installed()
    return found


def __getattr__(name: str) -> Any:
    if name == "VARLEN":
        return api()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CUDNN_MIN_Q = 128        # cuDNN's varlen branch takes max_q > 128 only
CUDNN_HEAD_DIM = 128     # ... and head dims up to 128 (Hopper; some larger pairs on sm100 only)


def cudnn_fits(q: torch.Tensor, cu_q, cu_k, max_q: int, causal: bool, window: int | None = None) -> bool:
    """Whether cuDNN's varlen branch takes this call (kv heads repeated for it): torch's own constraints
    (``_cudnn_rejection_reasons``) less the device and cuDNN version, which ``rule.DeviceFacts`` checks.
    A windowed call stays on Flash (its window is documented there)."""
    return (window is None and max_q > CUDNN_MIN_Q and (not causal or cu_q is cu_k) and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= CUDNN_HEAD_DIM)


def call_backend(kernel: str, q, cu_q, cu_k, max_q: int, causal: bool, window: int | None = None) -> str:
    """The backend a ``varlen``/``varlen_cudnn`` call asks for: "cudnn" only for ``varlen_cudnn`` on a torch
    that selects and a call cuDNN takes (``cudnn_fits``), else "flash"."""
    found = api()
    wants = kernel == "varlen_cudnn" and found is not None and found.selects
    return "cudnn" if wants and cudnn_fits(q, cu_q, cu_k, max_q, causal, window) else "flash"


def _enabled(backend: str):
    """The ``sdpa_kernel`` choice for ``backend`` where ``varlen_attn`` selects by it: Flash alone, or cuDNN
    with Flash still enabled as the fallback inside the same call. Nothing on a torch that does not select."""
    found = api()
    if found is None or not found.selects:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if backend == "cudnn"
                       else [SDPBackend.FLASH_ATTENTION])


def _selected(backend: str, q, k, v, cu_q, cu_k, max_q: int, causal: bool) -> str:
    """What torch's own selection picks under ``_enabled(backend)`` (its ``_select_backend``, kv repeated as
    for the call), so the backward gets the backend the forward ran; ``backend`` where it cannot be asked."""
    found = api()
    select = found.select if found is not None else None
    if select is None or backend != "cudnn":
        return backend
    if k.shape[1] != q.shape[1]:
        k = k.narrow(1, 0, 1).expand(-1, q.shape[1], -1)    # a view with the repeated head count (shapes only)
    try:
        with _enabled(backend):
            picked = select(query=q, key=k, value=k, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q,
                            window_size=[-1, 0] if causal else [-1, -1])
    except TypeError:
        return backend
    return "cudnn" if picked == backend_value("cudnn") else "flash"


# --- attend -------------------------------------------------------------------------------------
def forward(q, k, v, cu, max_seqlen: int, scale: float, *, cudnn: bool = False, features=None) -> torch.Tensor:
    """Causal ``varlen_attn`` over the packed stream; differentiable (its own backward, or ours for cuDNN).
    ``features``: a window only (the caller checks ``takes_window``)."""
    window = _left(features)
    if call_backend("varlen_cudnn" if cudnn else "varlen", q, cu, cu, max_seqlen, True, window) == "cudnn":
        return _Cudnn.apply(q, k, v, LseSpec(cu, cu, max_seqlen, max_seqlen, True, scale, "varlen_cudnn",
                                             features=features))
    with _enabled("flash"):    # torch's autograd saves the backend it selected for its backward
        return api().forward(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, scale=scale, window=window)


class _Cudnn(torch.autograd.Function):
    """``varlen_attn`` on cuDNN with the backward on the forward's backend (autograd would run the backward
    outside the forward's ``sdpa_kernel`` choice, and torches before the selection recompute it)."""

    @staticmethod
    def forward(ctx, q, k, v, spec: LseSpec):
        out, lse = lse_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*lse_backward(dout, q, k, v, out, lse, ctx.spec, None), None)


def _left(features) -> int | None:
    return None if features is None else features.window


# --- lse forms ----------------------------------------------------------------------------------
def _spec_backend(q, spec: LseSpec) -> str:
    return call_backend(spec.kernel, q, spec.cu_q, spec.cu_k, spec.max_q, spec.causal, _left(spec.features))


def lse_forward(q, k, v, spec: LseSpec):
    """Raw ``(out, lse)``: rows without keys carry FA2's ``+inf``, padding rows whatever the kernel left."""
    backend = _spec_backend(q, spec)
    with _enabled(backend):
        return api().forward(q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.max_k, causal=spec.causal,
                             scale=spec.scale, lse=True, repeat_kv=backend == "cudnn", window=_left(spec.features))


def _kernel_backward(dout, q, k, v, out, lse, spec: LseSpec):
    backend = _spec_backend(q, spec)       # the forward's: the same spec decides the same way
    ran = _selected(backend, q, k, v, spec.cu_q, spec.cu_k, spec.max_q, spec.causal)
    lse = torch.where(torch.isinf(lse), math.inf, lse).contiguous()              # back to FA2's convention
    with _enabled(backend):
        return api().backward(dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse, spec.cu_q, spec.cu_k,
                              spec.max_q, spec.max_k, causal=spec.causal, scale=spec.scale,
                              repeat_kv=backend == "cudnn", window=_left(spec.features), backend=ran)


def lse_backward(dout, q, k, v, out, lse, spec: LseSpec, dlse):
    """Raw ``(dq, dk, dv)`` from (possibly merged) statistics; ``dlse`` adds the lse output's gradient."""
    dq, dk, dv = _kernel_backward(dout, q, k, v, out, lse, spec)
    if dlse is not None:
        # d lse_i = scale * sum_j P_ij (dq_i: k_j ; dk_j: q_i). sum_j P_ij k_j is attention with v := k;
        # sum_i g_i P_ij q_i is the dv a kernel backward returns for dO := g * q.
        live = torch.isfinite(lse)                                                  # [heads, tq]
        g = torch.where(live, dlse.float(), 0.0).t().unsqueeze(-1)                  # [tq, heads, 1]
        attn_k, _ = lse_forward(q, k, k, spec)
        attn_k = torch.where(live.t().unsqueeze(-1), attn_k.float(), 0.0)           # rows without keys: 0, not NaN
        dq = (dq.float() + spec.scale * g * attn_k).to(q.dtype)
        _, _, p_t_q = _kernel_backward((g * q.float()).to(q.dtype), q, k, k, out, lse, spec)
        dk = (dk.float() + spec.scale * p_t_q.float()).to(k.dtype)
    return dq, dk, dv
