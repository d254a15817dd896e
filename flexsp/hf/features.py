"""Which attention features a model uses that FlexSP's packed causal Ulysses attention cannot honour.

FlexSP replaces the model's attention with plain causal attention inside each packed sequence. A
model that needs more (a sliding window shorter than its sequences, logit soft-capping, attention
sinks, dropout, bidirectional or cross-attention, scaled logits) would train on silently different maths, so
it is refused up front with an error naming the model and the feature. The same checks run again
per attention call (``attention.py``) on what the model actually passes, as a safety net.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from flexsp.errors import FlexSPError


class UnsupportedModelError(FlexSPError):
    """The model uses an attention or output feature FlexSP cannot reproduce exactly."""


def takes_kwargs(fn: Any) -> bool:
    """Whether ``fn`` accepts arbitrary keyword arguments (a ``**kwargs`` parameter)."""
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def model_name(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    return f"{type(model).__name__}" + (f" (model_type {kind!r})" if kind else "")


def text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sliding_window(model: nn.Module) -> int | None:
    """The smallest attention window any layer uses, or None when every layer attends fully."""
    cfg = text_config(model)
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(t) or "local" in str(t) for t in layer_types):
        return None
    return int(window)


def decoder_of(model: nn.Module) -> nn.Module:
    """The language model's decoder (``get_decoder()``; a causal LM whose lookup falls back to itself, such as
    Llama 4's or Mllama's text-only class, holds it as ``.model``)."""
    decoder = model.get_decoder()
    return getattr(model, "model", decoder) if decoder is model else decoder


def chunked_attention(model: nn.Module) -> int | None:
    """The attention chunk of a model with "chunked_attention" layers (Llama 4), or None."""
    cfg = text_config(model)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    if chunk is None or (types is not None and "chunked_attention" not in [str(t) for t in types]):
        return None
    return int(chunk)


def language_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The named modules that run on text: all of a causal LM; the language model (decoder) and output
    head of a composite (multimodal) model, whose vision or audio towers FlexSP neither runs nor trains."""
    if text_config(model) is model.config or not hasattr(model, "get_decoder"):
        return list(model.named_modules())
    decoder, head = decoder_of(model), model.get_output_embeddings()
    keep = {id(m) for part in (decoder, head) if part is not None for m in part.modules()}
    return [(n, m) for n, m in model.named_modules() if id(m) in keep]


def check_supported(model: nn.Module, max_seqlen: int | None = None) -> None:
    """Raise ``UnsupportedModelError`` naming ``model`` and the first feature FlexSP cannot honour.

    A sliding window is fine when no sequence is longer than it (the window then masks nothing):
    pass the longest sequence you will train as ``max_seqlen``.
    """
    cfg, name = text_config(model), model_name(model)

    def refuse(feature: str, detail: str) -> None:
        raise UnsupportedModelError(f"{name} uses {feature} ({detail}), which FlexSP's packed causal Ulysses "
                                    f"attention cannot honour")

    # Causality as the model computes it: transformers' mask builders read config.is_causal, and each
    # attention module carries its own is_causal. (config.is_decoder is not read: GPT-NeoX sets it False
    # although its attention is causal.)
    if getattr(cfg, "is_causal", True) is False:
        refuse("non-causal attention", "config.is_causal=False, which transformers' mask builders honour")
    for mod_name, module in language_modules(model):
        kind = type(module).__name__
        if "crossattention" in kind.lower() or mod_name.rsplit(".", 1)[-1] in ("crossattention", "cross_attn",
                                                                                "encoder_attn"):
            refuse("cross-attention", f"module {mod_name} ({kind})")
        if kind.endswith("Attention") and getattr(module, "is_causal", True) is False:
            refuse("non-causal attention", f"module {mod_name} ({kind}) has is_causal=False")
    if getattr(cfg, "add_cross_attention", False):
        refuse("cross-attention", "config.add_cross_attention=True")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and not takes_kwargs(type(decoder).forward):
        refuse("a decoder forward without **kwargs", f"{type(decoder).__name__}.forward cannot carry the context "
                                                     f"to the attention layers")
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, attr, None) is not None:
            refuse("logit softcap", f"config.{attr}={getattr(cfg, attr)}")
    for attr in ("logit_scale", "logits_scaling"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            refuse("logit scaling", f"config.{attr}={getattr(cfg, attr)}")
    dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        refuse("attention dropout > 0", f"config.attention_dropout={dropout}; set it to 0.0")
    sinks = [n for n, p in model.named_parameters() if n.endswith(".sinks")]
    if sinks:
        refuse("attention sinks", f"parameter {sinks[0]}")
    chunk = chunked_attention(model)
    if chunk is not None and (max_seqlen is None or max_seqlen > chunk):
        got = "max_seqlen not given" if max_seqlen is None else f"max_seqlen={max_seqlen}"
        refuse("chunked attention", f"chunks of {chunk} tokens, {got}; FlexSP is exact only when every sequence "
                                    f"fits one chunk: pass max_seqlen <= {chunk}")
    window = sliding_window(model)
    if window is not None and (max_seqlen is None or max_seqlen > window):
        got = "max_seqlen not given" if max_seqlen is None else f"max_seqlen={max_seqlen}"
        refuse("sliding-window attention", f"window {window} tokens, {got}; FlexSP is exact only when every sequence "
                                           f"fits the window: pass max_seqlen <= {window}")


def check_call(module: nn.Module, ctx_max_seqlen: int, *, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, s_aux: Any = None, is_causal: bool | None = None) -> None:
    """The per-call check: what this attention layer asked for, against what FlexSP computes."""
    name = type(module).__name__

    def refuse(feature: str, detail: str) -> None:
        raise UnsupportedModelError(f"{name} asked for {feature} ({detail}), which FlexSP's packed causal "
                                    f"Ulysses attention cannot honour")

    if dropout and float(dropout) > 0:
        refuse("attention dropout > 0", f"dropout={dropout}")
    if softcap is not None:
        refuse("logit softcap", f"softcap={softcap}")
    if s_aux is not None:
        refuse("attention sinks", "s_aux is set")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        refuse("non-causal attention", "is_causal=False")
    if sliding_window is not None and ctx_max_seqlen > int(sliding_window):
        refuse("sliding-window attention", f"window {sliding_window} tokens but a packed sequence has {ctx_max_seqlen}")
