"""The one registry of model shapes and GPUs: every model FlexSP plans, profiles, trains or tests.

A ``ModelSpec`` is a decoder's shape (layers, hidden, heads, kv heads, FFN, vocabulary) plus what
the parts that use it need: the runtime's ``TinyLM`` builds itself from one (rotary base, norm eps,
tied head), ``flexsp.hf`` turns the ``hf-*`` entries into tiny random-init transformers configs
(``family`` is their ``model_type``), and the paper's GPT models carry the published cost-model
constants (``paper``) that ``flexsp.plan.presets`` turns into a ``CostModel``. Everything else
(analytic cost models, ``flexsp profile``, replay) reads the shape fields.

``register_model(spec)`` adds an entry (a clear error on a taken name); ``get_model(name)`` finds one.
``spec_from_hf_config`` is the one conversion from a transformers config to a spec. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from flexsp.errors import CostModelError

SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


@dataclass(frozen=True)
class PaperConstants:
    """The FlexSP paper's published measurements for one model on 64 x A100-40GB (times in ms, memory in MB).

    Parameters were published at 192K and 384K context only; ``params_b`` interpolates linearly between."""

    act_mb_per_token: float
    alpha1_ms: float
    alpha2_ms: float
    beta1_ms: float
    params_b_192k: float
    params_b_384k: float

    def params_b(self, context: int) -> float:
        lo, hi = 192 * 1024, 384 * 1024
        return self.params_b_192k + (self.params_b_384k - self.params_b_192k) * (context - lo) / (hi - lo)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, and the settings the runtime and ``flexsp.hf`` build it with."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    name: str = "custom"
    family: str = "llama"                 # architecture; for ``hf-*`` entries the transformers model_type
    head_dim: int | None = None           # None: hidden // heads
    tie_embeddings: bool = False          # LM head shares the embedding matrix
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    paper: PaperConstants | None = None   # the paper's published constants (gpt-7b/13b/30b)
    hf_extra: tuple[tuple[str, Any], ...] = ()   # further transformers config keys of a tiny ``hf-*`` config

    def __post_init__(self) -> None:
        for field in SHAPE_FIELDS:   # layers may be 0: the embedding and head alone (profiling extrapolates blocks)
            value, least = getattr(self, field), 0 if field == "layers" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CostModelError(f"model {self.name!r}: {field} must be an integer >= {least}, got {value!r}")
        if self.heads % self.kv_heads:
            raise CostModelError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads "
                                 f"({self.kv_heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise CostModelError(f"model {self.name!r}: hidden ({self.hidden}) is not divisible by heads "
                                 f"({self.heads}); give head_dim")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of K (or V) per token: the kv heads' share of ``hidden``."""
        return self.hidden * self.kv_heads // self.heads

    @property
    def params(self) -> float:
        per_layer = self.hidden * (self.hidden + 2 * self.kv_dim) + self.hidden * self.hidden + 3 * self.hidden * self.ffn
        heads = 1 if self.tie_embeddings else 2
        return self.layers * per_layer + heads * self.hidden * self.vocab

    @property
    def linear_params(self) -> float:
        """Weights each token multiplies (embedding lookup excluded, LM head included)."""
        return self.params - (0 if self.tie_embeddings else self.hidden * self.vocab)

    def training_flops(self, lengths: Iterable[int]) -> float:
        """Forward + backward FLOPs of a step over sequences of ``lengths`` tokens: ``6 x linear_params`` per
        token, and per sequence of ``s`` tokens causal attention's ``6 x layers x (heads x head_size) x s^2``
        (QK^T and PV, 2 FLOPs a multiply-add, half the square, three passes). The one count behind MFU
        (``flexsp.telemetry``), the selftest's TFLOP/s and the profile's sweep estimate."""
        tokens = squares = 0
        for n in lengths:
            n = int(n)
            tokens += n
            squares += n * n
        return 6.0 * self.linear_params * tokens + 6.0 * self.layers * self.heads * self.head_size * squares

    def shape(self) -> dict[str, Any]:
        """The six shape fields and the name: what a cost model records as ``meta["model"]``."""
        return {**{f: getattr(self, f) for f in SHAPE_FIELDS}, "name": self.name}


@dataclass(frozen=True)
class GPUSpec:
    peak_flops: float            # bf16 dense FLOP/s
    memory_bytes: float
    intra_node_bandwidth: float  # bytes/s per GPU that all-to-all achieves over NVLink
    inter_node_bandwidth: float  # bytes/s per GPU across nodes (its share of the node's NICs)
    efficiency: float = 0.5      # achieved / peak FLOP/s
    usable_memory: float = 0.9   # fraction left after the framework and fragmentation
    name: str = "custom"
    # seconds of one point-to-point message across nodes (the ring's per-hop latency): an assumption,
    # NCCL send/recv over InfiniBand with GPUDirect RDMA runs at a few microseconds (nccl-tests p2p)
    inter_node_latency: float = 5e-6


MODELS: dict[str, ModelSpec] = {}   # name -> spec, in registration order; add with register_model


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` under ``spec.name``; a ``CostModelError`` if the name is taken."""
    if not isinstance(spec, ModelSpec):
        raise CostModelError(f"register_model takes a ModelSpec, got {type(spec).__name__}")
    if spec.name in MODELS:
        raise CostModelError(f"a model named {spec.name!r} is already registered; pick another name")
    MODELS[spec.name] = spec
    return spec


def get_model(name: str) -> ModelSpec:
    if not isinstance(name, str) or name.lower() not in MODELS:
        raise CostModelError(f"unknown model {name!r}; choose one of {', '.join(model_names())} or give a ModelSpec")
    return MODELS[name.lower()]


def model_names(*, paper: bool | None = None, family: str | None = None, prefix: str = "") -> tuple[str, ...]:
    """Registered names; ``paper=True`` only those with the paper's constants, ``prefix`` e.g. ``"hf-"``."""
    return tuple(n for n, s in MODELS.items()
                 if (paper is None or (s.paper is not None) == paper) and n.startswith(prefix)
                 and (family is None or s.family == family))


def spec_from_hf_config(config: Any, name: str | None = None) -> ModelSpec:
    """The shape of a transformers config (its text part for multimodal ones): the one HF -> spec conversion."""
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None)
    hidden = int(text.hidden_size)
    return ModelSpec(layers=int(text.num_hidden_layers), hidden=hidden, heads=heads,
                     kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                     ffn=int(getattr(text, "intermediate_size", 0) or 4 * hidden), vocab=int(text.vocab_size),
                     name=name or f"hf:{getattr(text, 'model_type', 'model')}:"
                                  f"{getattr(config, 'name_or_path', '') or 'config'}",
                     family=str(getattr(text, "model_type", "llama")),
                     head_dim=None if head_dim is None or int(head_dim) * heads == hidden else int(head_dim),
                     tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def hf_extra(**keys: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(keys.items()))


# --- the built-in entries ---------------------------------------------------------------------
# The paper's GPT models: hidden and layers as published; heads (head dim 128), FFN (4 x hidden) and
# vocabulary (GPT-2's) follow the GPT-3 family convention, which the paper does not list.
for _name, _hidden, _layers, _heads, _paper in (
        ("gpt-7b", 4096, 32, 32, PaperConstants(4.480441895, 5.128e-6, 0.1839576, 629.3563, 7.12, 7.85)),
        ("gpt-13b", 5120, 40, 40, PaperConstants(4.220439453, 9.2852e-6, 0.3060189, 1132.5632, 13.12, 14.03)),
        ("gpt-30b", 6656, 60, 52, PaperConstants(3.417381836, 15.4262e-6, 0.8035742, 2789.3644, 31.53, 32.72))):
    register_model(ModelSpec(_layers, _hidden, _heads, _heads, 4 * _hidden, 50257, _name, family="gpt", paper=_paper))
register_model(ModelSpec(32, 4096, 32, 32, 11008, 32000, "llama-7b"))
register_model(ModelSpec(40, 5120, 40, 40, 13824, 32000, "llama-13b"))
register_model(ModelSpec(32, 4096, 32, 8, 14336, 128256, "llama3-8b"))
register_model(ModelSpec(80, 8192, 64, 8, 28672, 128256, "llama3-70b"))
# Small shapes for profiling on a CPU or a laptop.
register_model(ModelSpec(2, 128, 4, 2, 256, 512, "tiny"))
register_model(ModelSpec(4, 256, 8, 4, 688, 1024, "small"))
# The runtime's built-in TinyLM at its example size (tests and examples start from it).
register_model(ModelSpec(2, 64, 4, 2, 128, 256, "tiny-lm", tie_embeddings=True))
# Tiny random-init transformers configs (``flexsp.hf.tiny_config``): one per family the tests train.
_HF_TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
for _family, _overrides in (
        ("llama", {}),
        ("qwen2", {}),                                            # q/k/v projections with bias
        ("qwen3", {"head_dim": 32}),                              # q/k RMSNorm, head_dim independent of hidden/heads
        ("mistral", {}),                                          # sliding_window 4096 by default: exact below it
        ("gemma", {"head_dim": 32, "kv_heads": 1, "tie_embeddings": True}),   # MQA, tied, scaled embedding
        ("phi3", {"hf_extra": hf_extra(pad_token_id=0, bos_token_id=1, eos_token_id=2)})):   # fused projections
    register_model(ModelSpec(**{**_HF_TINY, **_overrides}, name=f"hf-{_family}", family=_family))

GPUS: Mapping[str, GPUSpec] = {
    # Achieved, not nominal, bandwidths: the A100 entries reproduce the paper's cluster (all-to-all at
    # ~100 GB/s inside a node, 400 Gb/s InfiniBand per 8-GPU node); H100 assumes one 400 Gb/s NIC per GPU.
    "a100-40gb": GPUSpec(312e12, 40 * 2**30, 90e9, 6.25e9, name="a100-40gb"),
    "a100-80gb": GPUSpec(312e12, 80 * 2**30, 90e9, 6.25e9, name="a100-80gb"),
    "h100-80gb": GPUSpec(989e12, 80 * 2**30, 200e9, 40e9, name="h100-80gb"),
}


def get_gpu(name: str) -> GPUSpec:
    if not isinstance(name, str) or name not in GPUS:
        raise CostModelError(f"unknown GPU {name!r}; choose one of {sorted(GPUS)} or pass a GPUSpec")
    return GPUS[name]
