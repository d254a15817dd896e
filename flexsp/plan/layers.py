"""What each decoder layer is: its token mixer and its FFN, for the cost, memory and FLOP models. Torch-free.

A ``LayerKind`` is one layer's mixing and features:

* ``mixer``: ``"full"`` (causal softmax attention over the whole sequence), ``"window"`` (causal, each query
  sees its last ``size`` keys, itself included: transformers' ``sliding_window``), ``"chunk"`` (causal inside
  aligned chunks of ``size`` tokens: Llama 4's ``attention_chunk_size``) or ``"linear"`` (a linear-attention /
  recurrent mixer such as Gated DeltaNet: work and state linear in the length);
* ``sinks``: learned per-head sink logits (GPT-OSS): one more softmax term per query, no extra keys;
* ``moe``: the layer's FFN is the model's mixture of experts (``ModelSpec.experts``), else its dense ``ffn``;
* ``rope``: rotary positions (Llama 4's NoPE layers have none); the cost does not depend on it.

A ``ModelSpec`` keeps its layers as runs, ``((kind, count), ...)`` in layer order (``runs`` compresses a
per-layer list): a 94-layer model with two kinds is a handful of entries, and ``()`` means every layer is
full attention with a dense FFN (every spec written before kinds existed).

Attention work per sequence of ``s`` tokens is measured in ``pairs``: ``sum over positions of
(2 * keys(p) - 1)``, i.e. the exact count of query-key pairs with the diagonal counted half. For a full
layer that is exactly ``s^2`` (the contract's ``alpha1 * s^2``); a window ``w`` gives ``s^2`` up to ``w`` and
``w^2 + (s - w)(2w - 1)`` beyond (``keys(p) = min(p + 1, w)``); a chunk ``c`` gives ``q c^2 + r^2`` for
``s = q c + r``. A linear layer has no pair term: its mixing is linear in ``s``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from flexsp.errors import CostModelError

MIXERS = ("full", "window", "chunk", "linear")
SIZED = ("window", "chunk")        # mixers with a size in tokens


@dataclass(frozen=True)
class LayerKind:
    """One layer's token mixer and features (module docstring)."""

    mixer: str = "full"
    size: int = 0                  # window or chunk in tokens; 0 for full and linear layers
    sinks: bool = False
    moe: bool = False
    rope: bool = True

    def __post_init__(self) -> None:
        if self.mixer not in MIXERS:
            raise CostModelError(f"layer mixer {self.mixer!r} is not one of {', '.join(MIXERS)}")
        if isinstance(self.size, bool) or not isinstance(self.size, (int, np.integer)):
            raise CostModelError(f"layer {self.mixer} size must be a whole number of tokens, got {self.size!r}")
        if self.mixer in SIZED and self.size <= 0:
            raise CostModelError(f"a {self.mixer} layer needs a {self.mixer} of at least 1 token, got {self.size}")
        if self.mixer not in SIZED and self.size != 0:
            raise CostModelError(f"a {self.mixer} layer has no size, got {self.size}")
        object.__setattr__(self, "size", int(self.size))

    @property
    def softmax(self) -> bool:
        """Whether the mixer is softmax attention (full, window or chunk): K/V exchanged, flash activations."""
        return self.mixer != "linear"

    @property
    def term(self) -> tuple[str, int] | None:
        """The pair term this layer adds beyond ``alpha1 * s^2``: ``(mixer, size)`` for windows and chunks,
        None for full layers (``s^2``) and linear ones (no pair term)."""
        return (self.mixer, self.size) if self.mixer in SIZED else None

    def describe(self) -> str:
        text = self.mixer + (f" {self.size}" if self.size else "")
        return text + " +sinks" * self.sinks + " +moe" * self.moe + " nope" * (not self.rope)


FULL = LayerKind()


@dataclass(frozen=True)
class LatentShape:
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): q through a ``q_rank`` bottleneck (0: a direct
    projection), k and v through one shared ``kv_rank`` latent; each head's q/k is ``nope + rope`` wide (the
    spec's head size) and its v ``v_dim``. Only the weights and the v width differ from plain attention."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v_dim: int

    def __post_init__(self) -> None:
        for name in ("q_rank", "kv_rank", "nope", "rope", "v_dim"):
            value, least = getattr(self, name), 0 if name in ("q_rank", "nope", "rope") else 1
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise CostModelError(f"latent attention {name} must be a whole number >= {least}, got {value!r}")

    def params(self, hidden: int, heads: int) -> int:
        """q (bottleneck or direct), the shared kv latent with the rope key, its per-head k/v up-projection, out."""
        qk = self.nope + self.rope
        q = hidden * self.q_rank + self.q_rank * heads * qk if self.q_rank else hidden * heads * qk
        return (q + hidden * (self.kv_rank + self.rope) + self.kv_rank * heads * (self.nope + self.v_dim)
                + heads * self.v_dim * hidden)


@dataclass(frozen=True)
class LinearShape:
    """A linear-attention layer's heads (Gated DeltaNet as in Qwen3-Next / Qwen3.5): ``k_heads`` query/key
    heads of ``k_dim``, ``v_heads`` value heads of ``v_dim``, a causal depthwise convolution of ``conv`` taps."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int = 4

    def __post_init__(self) -> None:
        for name in ("k_heads", "v_heads", "k_dim", "v_dim", "conv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise CostModelError(f"linear attention {name} must be a whole number >= 1, got {value!r}")

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    # chunk of the chunked (parallel) form the FLOP estimate assumes: fla's chunk_gated_delta_rule uses 64
    CHUNK = 64

    def mixing_flops_per_token(self) -> float:
        """Forward FLOPs of the recurrence per token (an estimate): per value head, the state read, update
        and output (``3 k_dim v_dim`` multiply-adds) plus the intra-chunk attention of the chunked form
        (``CHUNK (k_dim + v_dim)`` multiply-adds); 2 FLOPs a multiply-add."""
        return 2.0 * self.v_heads * (3 * self.k_dim * self.v_dim + self.CHUNK * (self.k_dim + self.v_dim))


def runs(kinds: Iterable[LayerKind]) -> tuple[tuple[LayerKind, int], ...]:
    """A per-layer list of kinds as runs ``((kind, count), ...)`` in layer order; all-full-dense gives ``()``."""
    out: list[list] = []
    for kind in kinds:
        if not isinstance(kind, LayerKind):
            raise CostModelError(f"layer kinds must be LayerKind records, got {kind!r}")
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    if all(kind == FULL for kind, _ in out):
        return ()
    return tuple((kind, count) for kind, count in out)


def pairs(lengths, mixer: str, size: int = 0) -> np.ndarray:
    """Attention pairs (module docstring) of sequences of ``lengths`` tokens for one layer, vectorised."""
    s = np.asarray(lengths, dtype=np.float64)
    if mixer == "full":
        return s * s
    if mixer == "window":
        m = np.minimum(s, size)
        return m * m + (s - m) * (2.0 * size - 1.0)
    if mixer == "chunk":
        q, r = np.floor_divide(s, size), np.mod(s, size)
        return q * float(size) * size + r * r
    if mixer == "linear":
        return np.zeros_like(s)
    raise CostModelError(f"layer mixer {mixer!r} is not one of {', '.join(MIXERS)}")


def check_runs(layout: Sequence, layers: int, name: str) -> tuple[tuple[LayerKind, int], ...]:
    """``layout`` (runs) checked against the layer count; a ``CostModelError`` naming the mismatch."""
    try:
        layout = tuple((kind, count) for kind, count in layout)
    except (TypeError, ValueError):
        raise CostModelError(f"model {name!r}: layer_kinds must be runs ((LayerKind, count), ...), "
                             f"got {layout!r}") from None
    total = 0
    for i, (kind, count) in enumerate(layout):
        if not isinstance(kind, LayerKind):
            raise CostModelError(f"model {name!r}: layer run {i} is not a LayerKind, got {kind!r}")
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise CostModelError(f"model {name!r}: layer run {i} ({kind.describe()}) needs a count >= 1, got {count!r}")
        total += int(count)
    if layout and total != layers:
        raise CostModelError(f"model {name!r}: its layer kinds cover {total} layers but the model has {layers}")
    return tuple((kind, int(count)) for kind, count in layout)
