"""FlexSP attention inside transformers' attention registry, under the model's own key.

``install(key)`` replaces ``ALL_ATTENTION_FUNCTIONS[key]`` (``"sdpa"``, ``"eager"``,
``"flash_attention_2"``, ...) with a wrapper. A call that carries the per-step context in the
``flexsp_attention`` keyword - the adapter passes it to the decoder's ``forward(**kwargs)`` and
transformers hands every layer's attention function those kwargs - runs FlexSP's Ulysses attention
over the step's SP group and packed ``cu_seqlens``. Any other call goes to the original function
unchanged, so the same process can still run the plain model. Keeping the key (rather than a new
name) keeps transformers' own handling of it: config validation, kernel loading, mask creation.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flexsp.hf.features import FEATURES_ATTR, UnsupportedModelError, check_call
from flexsp.runtime.kernels.features import Features
from flexsp.runtime.sp.attention import sp_attention
from flexsp.runtime.sp.context import AttentionContext

CONTEXT_KWARG = "flexsp_attention"   # the forward kwarg that carries the AttentionContext
RECOMPUTE_ATTR = "flexsp_recompute_attention"   # set on a layer's modules: recompute the attention core in backward
POSITIONS_KWARG = "flexsp_positions"  # this shard's position ids, for layers that scale by position (Llama 4)
RECEIPT_KWARG = "flexsp_receipt"     # a list each FlexSP attention call appends to: proof SP really ran
_MARK = "_flexsp_original"           # attribute of an installed wrapper: the function it wraps


def _registry():
    try:   # detected, not assumed: the attention registry is what FlexSP plugs into
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        import transformers
        raise UnsupportedModelError(f"transformers {transformers.__version__} has no attention registry "
                                    f"(ALL_ATTENTION_FUNCTIONS); install the range of flexsp's `hf` extra") from None
    return ALL_ATTENTION_FUNCTIONS


def _eager_of(module: nn.Module) -> Callable:
    """The model's own eager attention (each modeling file has one; transformers' default for 'eager')."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
    return fn


def is_installed(key: str) -> bool:
    registry = _registry()
    return key in registry and hasattr(registry[key], _MARK)


def install(key: str) -> None:
    """Wrap the attention function registered as ``key`` (idempotent)."""
    if key is None or key.startswith("paged"):
        raise UnsupportedModelError(f"attention implementation {key!r} cannot be trained with FlexSP "
                                    f"(use sdpa, eager or a flash attention key)")
    if is_installed(key):
        return
    registry = _registry()
    original = registry[key] if key in registry else None   # None: the model's own eager function
    registry[key] = make_wrapper(original)


def uninstall(key: str) -> None:
    """Put back the function ``install(key)`` wrapped."""
    registry = _registry()
    if not is_installed(key):
        return
    original = getattr(registry[key], _MARK)
    if original is None:
        del registry[key]
    else:
        registry[key] = original


def make_wrapper(original: Callable | None) -> Callable:
    """The registry function: FlexSP when the call carries a context, else ``original`` (or the model's eager)."""

    def flexsp_or_original(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any):
        ctx = kwargs.pop(CONTEXT_KWARG, None)
        receipt = kwargs.pop(RECEIPT_KWARG, None)
        positions = kwargs.pop(POSITIONS_KWARG, None)
        if ctx is None:
            fn = original if original is not None else _eager_of(module)
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        if positions is not None:
            query = temperature_fixed(module, query, positions)
        out = flexsp_attention(module, query, key, value, attention_mask, ctx, **kwargs)
        if receipt is not None:
            receipt.append(getattr(module, "layer_idx", None))
        return out

    setattr(flexsp_or_original, _MARK, original)
    return flexsp_or_original


def temperature_scale(module: nn.Module, index: torch.Tensor) -> torch.Tensor:
    """Llama 4's attention temperature tuning of a NoPE layer: fp32 query scales at token ``index``."""
    return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def temperature_tuned(module: nn.Module) -> bool:
    """A layer that scales its queries by position (``attn_temperature_tuning`` on a NoPE layer; ``use_rope``
    is transformers' 0/1 from ``no_rope_layers``)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not bool(getattr(module, "use_rope", True))


def temperature_fixed(module: nn.Module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``query [1, heads, rows, dim]`` scaled by each token's position in its sequence instead of its row index
    in the call: transformers scales by ``arange(rows)``, which equals the position only for one unpacked
    sequence (the same in fp64; one extra rounding in bf16)."""
    if not temperature_tuned(module):
        return query
    rows, wide = query.shape[2], torch.promote_types(query.dtype, torch.float32)   # fp64 stays fp64
    wanted = temperature_scale(module, positions.reshape(-1)).to(wide)      # the fp32 scales transformers makes
    applied = temperature_scale(module, torch.arange(rows, device=query.device)).to(wide)
    return (query.to(wide) * (wanted / applied).view(1, 1, rows, 1)).to(query.dtype)


def flexsp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, ctx: AttentionContext, *, scaling: float | None = None,
                     dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: Any = None, is_causal: bool | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' calling convention around ``sp_attention``.

    In: ``query [1, heads, tokens/d, dim]``, ``key``/``value`` ``[1, kv_heads, tokens/d, dim]`` (this
    rank's shard, rotary already applied from per-sequence position ids). Out: ``[1, tokens/d, heads,
    dim]`` and no attention weights. The mask is ignored: the packed layout is ``ctx.cu_seqlens``.
    The layer's window, chunk and softcap are the ``Features`` the adapter read from the model once
    (``module.flexsp_features``), checked against what the call asks for; ``s_aux`` (GPT-OSS's sinks
    parameter, all heads) goes down as the layer's sink logits.
    """
    features = getattr(module, FEATURES_ATTR, None)
    check_call(module, ctx.max_seqlen, dropout=dropout, sliding_window=sliding_window, softcap=softcap,
               s_aux=s_aux, is_causal=is_causal, features=features)
    if features is None:   # a module the adapter did not prepare: what the call asks for
        features = Features(window=sliding_window, softcap=softcap)
    if query.dim() != 4 or query.shape[0] != 1:
        raise UnsupportedModelError(f"{type(module).__name__}: FlexSP runs one packed row (batch 1), got query "
                                    f"{tuple(query.shape)}")
    if attention_mask is not None and attention_mask.numel() > 0:
        raise UnsupportedModelError(f"{type(module).__name__}: FlexSP takes no attention mask (the packed layout "
                                    f"comes from cu_seqlens), got one of shape {tuple(attention_mask.shape)}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [tokens/d, heads, dim]
    device = q.device.type
    if torch.is_autocast_enabled(device):   # as autocast casts SDPA's inputs in the model's own path: fp32 rotary
        low = torch.get_autocast_dtype(device)   # output beside bf16 v would send fp32 q/k to the kernels and wires
        q, k, v = q.to(low), k.to(low), v.to(low)
    # the model's own scale goes to the kernel (folded into a bf16 q it would round q a second time: Gemma 2's
    # query_pre_attn_scalar, Granite's attention_multiplier, DeepSeek's yarn mscale)
    scale = None if scaling is None else float(scaling)
    if getattr(module, RECOMPUTE_ATTR, False) and torch.is_grad_enabled():   # selective recompute
        out = checkpoint(sp_attention, q, k, v, ctx, features, s_aux, scale, use_reentrant=False)
    else:
        out = sp_attention(q, k, v, ctx, features, s_aux, scale)
    return out.unsqueeze(0).contiguous(), None   # as transformers' own functions return it (callers .view it)
