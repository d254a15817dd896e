"""What a model's attention and LM head compute beyond plain causal attention: read once, passed down
per layer; and what FlexSP cannot honour, refused by name.

FlexSP replaces the model's attention with causal attention inside each packed sequence, plus the
layer's own features, read here once from the model (``layer_features``): a left sliding window
(``config.layer_types`` "sliding_attention", or every layer of a ``sliding_window`` config without
layer types whose modeling code applies a window: it passes ``sliding_window=`` to attention or builds a
sliding-window mask; the attention module's own ``sliding_window`` wins where it has one), chunked attention
("chunked_attention" layers: ``config.attention_chunk_size``), the score softcap
(``config.attn_logit_softcapping``) and attention sinks (the module's ``sinks`` parameter, GPT-OSS).
The LM head's logit scaling and final softcap (``logit_transform``, where the code computing the logits names
them) go to the loss. A model that needs
what cannot be computed (dropout, bidirectional or cross-attention) would train on silently different maths, so it is refused up front with
an error naming the model and the feature. The per-call check (``check_call``) compares what each
attention call asks for with what was read, as a safety net.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

from torch import nn

from flexsp.errors import FlexSPError
from flexsp.runtime.kernels.features import Features

SLIDING, CHUNKED, FULL = "sliding_attention", "chunked_attention", "full_attention"   # ``config.layer_types`` entries
FEATURES_ATTR = "flexsp_features"   # set on every attention module: its layer's ``Features``, read once
# logit transforms of LM heads: config attribute -> True when the model divides its logits by it
LOGIT_SCALES = {"logits_scaling": True, "logit_scale": False}
MULTIPLYING_LOGITS_SCALING = frozenset({"hyperclovax"})   # families whose ``logits_scaling`` multiplies


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


def decoder_of(model: nn.Module) -> nn.Module | None:
    """The decoder stack under an LM head: ``get_decoder()``, followed down while it returns an LM (the model
    itself: Llama 4's text LM names its base ``language_model`` but stores it as ``model``; or another LM with a
    head: Llama 4's multimodal class returns its text LM) to that LM's ``model``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for _ in range(3):
        if decoder is None or not (decoder is model or _has_lm_head(decoder)):
            return decoder
        inner = getattr(decoder, "model", None)
        if not isinstance(inner, nn.Module) or inner is decoder:
            return decoder
        model, decoder = decoder, inner
    return decoder


def _has_lm_head(module: nn.Module) -> bool:
    heads = getattr(module, "get_output_embeddings", None)
    return callable(heads) and heads() is not None


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The attention module of each decoder layer, by ``layer_idx``."""
    return {int(m.layer_idx): m for m in model.modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)}


def layer_features(model: nn.Module) -> dict[int, Features]:
    """Each decoder layer's attention features (``Features``), read once from the config and the modules.

    Window: ``config.layer_types[i] == "sliding_attention"`` (or, where no layer type is a sliding one,
    every attention layer of a config with ``sliding_window`` and ``use_sliding_window`` not False whose
    modeling code applies a window: Mistral-style models apply it everywhere), the attention module's own
    ``sliding_window`` attribute overriding; chunk: "chunked_attention" layers' ``attention_chunk_size``;
    softcap: ``attn_logit_softcapping``."""
    cfg = text_config(model)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    types = list(getattr(cfg, "layer_types", None) or [])
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    chunk = getattr(cfg, "attention_chunk_size", None)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    modules = attention_modules(model)
    out = {}
    # Qwen2-style configs derive layer_types from use_sliding_window and max_window_layers: there the types are
    # the whole truth (a full_attention layer has no window even with sliding_window set)
    derived = bool(types) and getattr(cfg, "max_window_layers", None) is not None
    for i in range(layers):
        kind, module = types[i] if i < len(types) else None, modules.get(i)
        # a config whose layer types name no sliding layer (none, or attention vs linear: MiniMax) builds its mask
        # with the window on every attention layer, as Mistral's does, when its modeling code applies a window at all
        # (Qwen3-VL-MoE's config may carry one its model never uses)
        everywhere = (SLIDING not in types and kind != CHUNKED and not derived
                      and (module is None or applies_window(type(module))))
        w = window if (kind == SLIDING or everywhere) else None
        if module is not None and hasattr(module, "sliding_window"):
            w = module.sliding_window
            if kind == FULL or getattr(module, "is_sliding", True) is False:
                w = None
        cap = softcap if module is None or passes_softcap(type(module)) else None
        out[i] = Features(window=None if w is None else int(w),
                          chunk=int(chunk) if kind == CHUNKED and chunk is not None else None,
                          softcap=None if cap is None else float(cap))
    return out


def applies_window(cls: type) -> bool:
    """Whether the modeling file of an attention class applies a sliding window anywhere: passes one to its attention
    function (Mistral's ``sliding_window=``) or builds a sliding-window mask (PhiMoE's). Qwen3-VL-MoE's file never
    names one and Moshi's only stores its config's 3,000, though both configs may carry a window."""
    return names_in_module(cls, "sliding_window=") or names_in_module(cls, "create_sliding_window_causal_mask")


@lru_cache(maxsize=None)
def names_in_module(cls: type, name: str) -> bool:
    """Whether a source file defining ``cls`` or a class it derives from mentions ``name`` (code that never names a
    config attribute cannot apply it; a user's subclass inherits the forward of the file it derives from).
    Unreadable source: assume it does."""
    for base in cls.__mro__:
        if base is object or base.__module__.startswith("torch."):
            continue
        try:
            if name in inspect.getsource(inspect.getmodule(base)):
                return True
        except (OSError, TypeError):
            return True
    return False


@lru_cache(maxsize=None)
def passes_softcap(cls: type) -> bool:
    """Whether an attention class's forward hands a score softcap to its attention function: Gemma 2 does, Gemma 3
    keeps ``attn_logit_softcapping`` in its config and never applies it (unreadable source: assume it does)."""
    try:
        return "softcap" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True


def has_sinks(module: nn.Module) -> bool:
    """The attention module carries per-head sink logits (GPT-OSS's ``sinks`` parameter)."""
    return isinstance(getattr(module, "sinks", None), nn.Parameter)


def logit_transform(model: nn.Module) -> tuple[float, float | None]:
    """``(scale, softcap)`` the model applies to its LM head's logits: ``logits * scale``, then
    ``softcap * tanh(logits / softcap)`` (Granite's ``logits_scaling`` divides, Cohere's ``logit_scale``
    multiplies; Gemma's ``final_logit_softcapping``), each only where the modeling code of the class computing the
    logits names it: a composite's text config may carry its causal LM's scale, which the composite never applies
    (Aya Vision: Cohere2's ``logit_scale``). The probe checks the result against the model."""
    cfg = text_config(model)
    scale = 1.0
    for attr, divides in LOGIT_SCALES.items():
        value = getattr(cfg, attr, None)
        if value in (None, 1, 1.0) or not names_in_module(type(model), attr):
            continue
        if getattr(cfg, "model_type", None) in MULTIPLYING_LOGITS_SCALING:
            divides = False
        scale *= 1.0 / float(value) if divides else float(value)
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is not None and not names_in_module(type(model), "final_logit_softcapping"):
        cap = None
    return scale, None if cap is None else float(cap)


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

    ``max_seqlen`` (the longest sequence you will train) is no longer needed for sliding windows, which
    are computed; length-dependent rotary embeddings ("longrope", "dynamic") are refused above the length
    where their frequencies switch (``length_dependent_rope``), checked only when it is given.
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
        if kind.endswith("Indexer"):   # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, ...): top-k over every key
            refuse("sparse attention with a key indexer", f"module {mod_name} ({kind}) scores every key of the "
                   f"sequence to pick which ones each query attends, outside the attention call FlexSP splits")
    if getattr(cfg, "add_cross_attention", False):
        refuse("cross-attention", "config.add_cross_attention=True")
    decoder = decoder_of(model)
    if decoder is not None and not takes_kwargs(type(decoder).forward):
        refuse("a decoder forward without **kwargs", f"{type(decoder).__name__}.forward cannot carry the context "
                                                     f"to the attention layers")
    dropout = float(getattr(cfg, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        refuse("attention dropout > 0", f"config.attention_dropout={dropout}; set it to 0.0")
    modules = attention_modules(model)
    owned = {id(m.sinks) for m in modules.values() if has_sinks(m)}
    stray = [n for n, p in model.named_parameters() if n.endswith(".sinks") and id(p) not in owned]
    if stray:
        refuse("attention sinks outside an attention layer's module", f"parameter {stray[0]}")
    try:
        layer_features(model)
    except FlexSPError as exc:
        refuse("attention features FlexSP cannot read", str(exc))
    if max_seqlen is not None:
        for kind, limit in length_dependent_rope(cfg):
            if max_seqlen > limit:
                refuse(f"rope_type {kind!r}", f"its frequencies switch past {limit} tokens by the longest position a "
                       f"call sees; FlexSP packs sequences and shards them over ranks, so a call's longest position "
                       f"is not each sequence's: sequences up to {limit} tokens train exactly, the longest here is "
                       f"{max_seqlen}")


def length_dependent_rope(cfg: Any) -> list[tuple[str, int]]:
    """``(rope_type, tokens)`` of every rotary embedding whose frequencies depend on the longest position of the
    call (transformers' ``dynamic_rope_update``): "longrope" switches to its long factors past
    ``original_max_position_embeddings``, "dynamic" rescales past ``max_position_embeddings``."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_layer = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    out = []
    for p in per_layer:
        kind = p.get("rope_type", p.get("type"))
        if kind == "longrope":
            out.append((kind, int(p.get("original_max_position_embeddings")
                                  or getattr(cfg, "original_max_position_embeddings", None)
                                  or cfg.max_position_embeddings)))
        elif kind == "dynamic":
            out.append((kind, int(cfg.max_position_embeddings)))
    return out


def check_call(module: nn.Module, ctx_max_seqlen: int, *, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, s_aux: Any = None, is_causal: bool | None = None,
               features: Features | None = None) -> None:
    """The per-call check: what this attention layer asked for, against what FlexSP computes for it
    (``features``: the layer's, read once; None: a module FlexSP did not prepare, which gets plain
    causal attention plus what the call asks for)."""
    name = type(module).__name__
    layer = getattr(module, "layer_idx", None)

    def refuse(feature: str, detail: str) -> None:
        raise UnsupportedModelError(f"{name} (layer {layer}) asked for {feature} ({detail}), which FlexSP's packed "
                                    f"causal attention cannot honour")

    if dropout and float(dropout) > 0:
        refuse("attention dropout > 0", f"dropout={dropout}")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        refuse("non-causal attention", "is_causal=False")
    if features is None:
        return
    if sliding_window is not None and features.window != int(sliding_window):
        refuse("a sliding window its config does not give this layer",
               f"sliding_window={sliding_window}, read from the model: {features.window}")
    if softcap is not None and (features.softcap is None or float(softcap) != features.softcap):
        refuse("a score softcap its config does not give this layer",
               f"softcap={softcap}, read from the model: {features.softcap}")
