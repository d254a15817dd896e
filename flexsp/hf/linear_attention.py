"""Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid, ...) under FlexSP: its convolution and recurrence over
whole sequences of this rank's heads.

A Gated DeltaNet layer projects each token (per token: fine on a token shard), runs a short depthwise
causal convolution and a gated delta-rule recurrence over the sequence (not fine: they need every earlier
token of the sequence), then a gated norm and an output projection (per token). transformers' modeling
files call the two sequence operators as module-level functions, ``causal_conv1d_fn(x, weight, bias,
activation, **kwargs)`` and ``torch_chunk_gated_delta_rule(q, k, v, g, beta, ..., **kwargs)``, and the
decoder layer hands them its ``**kwargs`` - FlexSP's per-step context included. ``install(module)``
wraps the two functions of a modeling module: a call that carries the context runs Ulysses for
recurrences (``flexsp.runtime.sp.linear``): an all-to-all to a head (channel) shard, the model's own
function per packed sequence (state restarted at each first token, padding rows zero), and back; any
other call runs the original unchanged. The model's projections, gates and norm run as written.

Kernels: the original functions are the modeling file's (transformers' torch code, or the
``causal-conv1d`` / flash-linear-attention kernels transformers binds when installed). On CUDA, with
flash-linear-attention installed (``pip install flash-linear-attention``: optional, feature-detected),
the recurrence runs once over the stream with its varlen ``cu_seqlens`` kernel instead of once per
distinct length; rows it leaves unwritten (padding) are zeroed.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from flexsp.hf.attention import CONTEXT_KWARG, RECEIPT_KWARG
from flexsp.hf.features import UnsupportedModelError
from flexsp.runtime.sp.context import ShardingError
from flexsp.runtime.sp.linear import ulysses_conv, ulysses_recurrence

CONV = "causal_conv1d_fn"
RULE = "torch_chunk_gated_delta_rule"
_MARK = "_flexsp_original"


def modeling_module(module: nn.Module):
    return sys.modules.get(type(module).__module__)


def is_gated_deltanet(module: nn.Module) -> bool:
    """A Gated DeltaNet mixer: its modeling file has both sequence operators and it has a depthwise conv."""
    mod = modeling_module(module)
    conv = getattr(module, "conv1d", None)
    return (mod is not None and callable(getattr(mod, CONV, None)) and callable(getattr(mod, RULE, None))
            and isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels
            and hasattr(module, "A_log") and hasattr(module, "dt_bias"))


def install(module: nn.Module) -> None:
    """Wrap the two sequence operators of ``module``'s modeling file (idempotent)."""
    mod = modeling_module(module)
    for name, make in ((CONV, _conv_wrapper), (RULE, _rule_wrapper)):
        fn = getattr(mod, name)
        if not hasattr(fn, _MARK):
            wrapper = make(fn)
            setattr(wrapper, _MARK, fn)
            setattr(mod, name, wrapper)


def uninstall(module: nn.Module) -> None:
    mod = modeling_module(module)
    for name in (CONV, RULE):
        fn = getattr(mod, name)
        if hasattr(fn, _MARK):
            setattr(mod, name, getattr(fn, _MARK))


def _refuse(exc: ShardingError) -> UnsupportedModelError:
    return UnsupportedModelError(str(exc))


def _conv_wrapper(original: Callable) -> Callable:
    def flexsp_or_original(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        ctx = kwargs.get(CONTEXT_KWARG)
        if ctx is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        if hidden_states.shape[0] != 1:
            raise UnsupportedModelError(f"FlexSP runs one packed row (batch 1), got {tuple(hidden_states.shape)}")

        def local(xs: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return original(xs.transpose(1, 2).contiguous(), w, b, activation=activation).transpose(1, 2)

        try:
            out = ulysses_conv(hidden_states[0].transpose(0, 1), [weight, bias], ctx, local)   # [tokens/d, C]
        except ShardingError as exc:
            raise _refuse(exc) from None
        return out.transpose(0, 1)[None]

    return flexsp_or_original


def _rule_wrapper(original: Callable) -> Callable:
    def flexsp_or_original(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           **kwargs: Any):
        ctx = kwargs.pop(CONTEXT_KWARG, None)
        receipt = kwargs.pop(RECEIPT_KWARG, None)
        if ctx is None:
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        extra = {k: kwargs[k] for k in ("chunk_size", "scale") if k in kwargs}   # the call's own settings
        if initial_state is not None or output_final_state:
            raise UnsupportedModelError("a Gated DeltaNet call with a recurrent state cache (generation) under "
                                        "FlexSP's training context")
        if query.shape[0] != 1:
            raise UnsupportedModelError(f"FlexSP runs one packed row (batch 1), got {tuple(query.shape)}")

        def local(q, k, v, gg, b):
            out = original(q, k, v, g=gg, beta=b, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)
            return out[0] if isinstance(out, tuple) else out

        varlen = fla_varlen(query.device, use_qk_l2norm_in_kernel)
        try:
            out = ulysses_recurrence(query[0], key[0], value[0], g[0], beta[0], ctx, local, varlen)
        except ShardingError as exc:
            raise _refuse(exc) from None
        if receipt is not None:
            receipt.append("gated_deltanet")
        return out[None], None

    return flexsp_or_original


def fla_varlen(device: torch.device, l2norm: bool) -> Callable | None:
    """flash-linear-attention's varlen gated delta rule on CUDA when installed, else None (per-length batches)."""
    if device.type != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:   # not installed, or it fails to import on this machine: the model's own function serves
        return None
    return make_varlen(chunk_gated_delta_rule, l2norm)


def make_varlen(kernel: Callable, l2norm: bool) -> Callable:
    """Adapt a varlen kernel with fla's signature to ``ulysses_recurrence``'s ``varlen``."""

    def varlen(q, k, v, g, beta, cu_seqlens):
        ratio = v.shape[1] // k.shape[1]
        if ratio > 1:   # grouped value heads: each key head serves ``ratio`` value heads
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        out = kernel(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=None,
                     output_final_state=False, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm)
        out = out[0] if isinstance(out, tuple) else out
        return out[0].to(v.dtype)

    return varlen
