"""Carry FlexSP's per-step context to attention modules whose decoder layer drops its ``**kwargs``.

transformers hands the decoder's forward kwargs down to every layer, and each layer to its attention
module, which passes them to the registry function (``attention.py``). Some layers (StableLM's)
call their attention without forwarding ``**kwargs``: the context never arrives and the original
attention runs on a packed shard with an empty mask. ``route_context`` puts two forward pre-hooks on
such a model: the decoder layer's stashes the context from its own kwargs (popping it when the layer
takes no ``**kwargs`` at all) and its attention module's puts it back into the attention call. The
stash lives on the layer, so gradient checkpointing (which re-calls the layer with the same kwargs)
routes it again. Hooks only act on a call that carries a context: the plain model is unchanged.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from torch import nn

from flexsp.hf.attention import CONTEXT_KWARG, RECEIPT_KWARG
from flexsp.hf.features import UnsupportedModelError, takes_kwargs

_STASH = "_flexsp_route"   # instance attribute (a dict) shared by a layer and its attention modules
_KEYS = (CONTEXT_KWARG, RECEIPT_KWARG)


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The outermost submodules of ``layer`` whose class is an attention (``*Attention``)."""
    found: list[nn.Module] = []
    for name, module in layer.named_modules():
        if not name or not type(module).__name__.endswith("Attention"):
            continue
        if any(module in set(outer.modules()) for outer in found):
            continue
        found.append(module)
    return found


def drops_kwargs(layer: nn.Module) -> bool:
    """Whether ``layer`` calls an attention module without passing its own ``**kwargs`` on.

    Read from the layer's forward source: a ``**kwargs`` parameter that the body never spreads
    into a call (StableLM), or no ``**kwargs`` at all.
    """
    forward = type(layer).forward
    if not takes_kwargs(forward):
        return True
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    name = next(p.name for p in inspect.signature(forward).parameters.values()
                if p.kind is inspect.Parameter.VAR_KEYWORD)
    spread = any(isinstance(node, ast.Call) and any(kw.arg is None and isinstance(kw.value, ast.Name)
                                                    and kw.value.id == name for kw in node.keywords)
                 for node in ast.walk(tree))
    return not spread


def _stash_from_layer(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    stash = module.__dict__[_STASH]
    stash.clear()
    if kwargs.get(CONTEXT_KWARG) is None:
        return None
    keep = takes_kwargs(type(module).forward)
    for key in _KEYS:
        if key in kwargs:
            stash[key] = kwargs[key] if keep else kwargs.pop(key)
    return args, kwargs


def _clear(module: nn.Module, args: Any, output: Any) -> None:
    module.__dict__[_STASH].clear()


def _inject_into_attention(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    stash = module.__dict__[_STASH]
    if not stash or kwargs.get(CONTEXT_KWARG) is not None:
        return None
    return args, {**kwargs, **stash}


def route_context(layers: list[nn.Module], name: str) -> list[str]:
    """Hook every layer of ``layers`` that drops kwargs; returns the class names it hooked (idempotent).

    Raises ``UnsupportedModelError`` when a hooked layer's attention module itself takes no ``**kwargs``
    (the context could not reach the registry function).
    """
    hooked: list[str] = []
    for layer in layers:
        if _STASH in layer.__dict__:
            hooked.append(type(layer).__name__)
            continue
        if not drops_kwargs(layer):
            continue
        attns = attention_modules(layer)
        if not attns:
            raise UnsupportedModelError(f"{name}: decoder layer {type(layer).__name__} does not pass attention kwargs "
                                        f"and has no *Attention submodule to hand them to")
        bad = [type(a).__name__ for a in attns if not takes_kwargs(type(a).forward)]
        if bad:
            raise UnsupportedModelError(f"{name}: decoder layer does not pass attention kwargs and its attention "
                                        f"{bad[0]} takes none, so FlexSP's context cannot reach it")
        stash: dict = {}
        layer.__dict__[_STASH] = stash
        layer.register_forward_pre_hook(_stash_from_layer, with_kwargs=True)
        layer.register_forward_hook(_clear)
        for attn in attns:
            attn.__dict__[_STASH] = stash
            attn.register_forward_pre_hook(_inject_into_attention, with_kwargs=True)
        hooked.append(type(layer).__name__)
    return hooked
