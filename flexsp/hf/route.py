"""Carry FlexSP's per-step context to attention modules whose decoder layer drops its ``**kwargs``.

transformers hands the decoder's forward kwargs down to every layer, and each layer to its attention
module, which passes them to the registry function (``attention.py``). Some layers (StableLM's)
call their attention without forwarding ``**kwargs``: the context never arrives and the original
attention runs on a packed shard with an empty mask. ``route_context`` finds such layers from their
forward's source (a ``**kwargs`` never spread into a call) and puts a forward pre-hook on their
attention modules that adds the context from the running layer's own ``**kwargs`` (read from the
call stack, so gradient checkpointing, which re-runs the layer's ``forward`` without hooks, is routed
too). A layer with no ``**kwargs`` at all gets a pre-hook that pops the context before it is
rejected and stashes it for its attention. Hooks only act on a call that carries a context: the plain
model is unchanged.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from typing import Any

from torch import nn

from flexsp.hf.attention import CONTEXT_KWARG, RECEIPT_KWARG
from flexsp.hf.features import UnsupportedModelError, takes_kwargs

_STASH = "_flexsp_route"   # instance attribute (a dict) shared by a layer and its attention modules
_KEYS = (CONTEXT_KWARG, RECEIPT_KWARG)
_DEPTH = 12   # frames searched above an attention call for its layer's forward


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
    """Layer pre-hook. A layer without ``**kwargs`` would reject the context: pop it into the stash."""
    stash = module.__dict__[_STASH]
    stash.clear()   # a context from an earlier call never leaks into this one
    if kwargs.get(CONTEXT_KWARG) is None or takes_kwargs(type(module).forward):
        return None
    for key in _KEYS:
        if key in kwargs:
            stash[key] = kwargs.pop(key)
    return args, kwargs


def _from_layer_frame(stash: dict) -> dict | None:
    """The context in the ``**kwargs`` of the running ``layer.forward`` (found on the call stack).

    Read from the frame rather than stashed by a hook because transformers' gradient checkpointing
    re-runs the layer's ``forward`` (not ``__call__``: no hooks) in backward, with its original kwargs."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner.__dict__.get(_STASH) is stash:   # the layer of this attention
            for value in frame.f_locals.values():
                if isinstance(value, dict) and value.get(CONTEXT_KWARG) is not None:
                    return {k: value[k] for k in _KEYS if k in value}
        frame = frame.f_back
    return None


def _inject_into_attention(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Attention pre-hook: add the layer's context to a call that lacks it."""
    if kwargs.get(CONTEXT_KWARG) is not None:
        return None
    stash = module.__dict__[_STASH]
    found = _from_layer_frame(stash) or {k: stash[k] for k in _KEYS if k in stash}
    if not found:
        return None
    return args, {**kwargs, **found}


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
        layer.__dict__[_STASH] = {}
        layer.register_forward_pre_hook(_stash_from_layer, with_kwargs=True)
        for attn in attns:
            attn.__dict__[_STASH] = layer.__dict__[_STASH]   # one dict: deepcopy keeps layer and attention paired
            attn.register_forward_pre_hook(_inject_into_attention, with_kwargs=True)
        hooked.append(type(layer).__name__)
    return hooked
