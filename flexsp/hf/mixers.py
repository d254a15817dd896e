"""The token mixers FlexSP runs under SP, one small interface each: the next architecture is a module plus
a registration here.

A ``TokenMixer``'s ``install(model)`` makes the calls of the model's mixers of its kind that carry
FlexSP's per-step context run over the step's SP group (calls without it run as before) and says
whether the model has any. ``prepare_model`` installs every registered kind; each SP-run mixer call
appends to the context's receipt, and the adapter checks that every decoder layer mixed its tokens
under SP (a kind nobody registered is refused there by name).

| kind | module | SP axis |
|---|---|---|
| softmax attention | ``attention`` (transformers' attention registry, under the model's key) | Ulysses, Ulysses x ring |
| linear attention (Gated DeltaNet) | ``linear_attention`` (the modeling file's conv and recurrence) | Ulysses (rings refused) |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from flexsp.hf import attention, linear_attention


@dataclass(frozen=True)
class TokenMixer:
    name: str
    install: Callable[[nn.Module], bool]   # wrap the model's mixers of this kind (idempotent); any found?
    ring: bool                             # runs exactly on a Ulysses x ring group


def _softmax_attention(model: nn.Module) -> bool:
    attention.install(model.config._attn_implementation)
    return True


def _gated_deltanet(model: nn.Module) -> bool:
    found = False
    for module in model.modules():
        if linear_attention.is_gated_deltanet(module):
            linear_attention.install(module)
            found = True
    return found


MIXERS: dict[str, TokenMixer] = {}


def register(mixer: TokenMixer) -> None:
    if mixer.name in MIXERS:
        raise ValueError(f"token mixer {mixer.name!r} is already registered")
    MIXERS[mixer.name] = mixer


register(TokenMixer("softmax attention", _softmax_attention, ring=True))
register(TokenMixer("linear attention (Gated DeltaNet)", _gated_deltanet, ring=False))


def install_mixers(model: nn.Module) -> tuple[str, ...]:
    """Install every registered kind the model uses; returns their names."""
    return tuple(m.name for m in MIXERS.values() if m.install(model))


def ring_capable(names: tuple[str, ...]) -> bool:
    """Whether every mixer kind named runs exactly on a ring group."""
    return all(MIXERS[n].ring for n in names)
