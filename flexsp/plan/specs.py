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

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from flexsp.errors import CostModelError
from flexsp.plan.layers import FULL, LatentShape, LayerKind, LinearShape, check_runs, pairs, runs

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
    """A decoder-only transformer's shape, and the settings the runtime and ``flexsp.hf`` build it with.

    Layers (``flexsp.plan.layers``): ``kinds`` holds runs ``((LayerKind, count), ...)`` in layer order, ``()``
    for every layer full causal attention with a dense FFN; ``layer_kinds`` is the per-layer view the runtime
    reads. MoE layers (``LayerKind(moe=True)``) route each token to ``active_experts`` of ``experts`` FFNs of
    width ``expert_ffn`` (0: ``ffn``) plus always-active shared experts of total width ``shared_ffn``; dense
    layers use ``ffn``. Giving ``experts`` without ``kinds`` makes every layer MoE. Linear-attention layers
    have the heads of ``linear`` (None: the attention's heads and head size)."""

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
    kinds: tuple[tuple[LayerKind, int], ...] = ()   # runs of layer kinds in layer order; () all full + dense
    experts: int = 0                      # routed experts of a MoE layer (0: no MoE)
    active_experts: int = 0               # routed experts each token runs
    expert_ffn: int = 0                   # one expert's FFN width (0: ffn)
    shared_ffn: int = 0                   # total FFN width of the shared (always active) experts
    linear: LinearShape | None = None     # linear-attention heads (None: heads x head size)
    implementation: str = "flexsp"        # what builds the layers: "flexsp" (TinyLM) or "transformers"
    attn_gate: bool = False               # attention output gated per head (Qwen3-Next / Qwen3.5: q_proj x 2)
    qk_norm: bool = False                 # RMSNorm on q and k per head (Qwen3, Gemma 3): more activations
    latent: LatentShape | None = None     # multi-head latent attention (DeepSeek-V3): its weights and v width
    gated_ffn: bool = True                # gate, up and down (SwiGLU); False: up and down (GPT-2, GPT-NeoX, Phi)

    def __post_init__(self) -> None:
        for field in SHAPE_FIELDS:   # layers may be 0: the embedding and head alone (profiling extrapolates blocks)
            value, least = getattr(self, field), 0 if field == "layers" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CostModelError(f"model {self.name!r}: {field} must be an integer >= {least}, got {value!r}")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or self.head_dim < 1):
            raise CostModelError(f"model {self.name!r}: head_dim must be an integer >= 1 (or None: hidden // heads), "
                                 f"got {self.head_dim!r}")
        if self.heads % self.kv_heads:
            raise CostModelError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads "
                                 f"({self.kv_heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise CostModelError(f"model {self.name!r}: hidden ({self.hidden}) is not divisible by heads "
                                 f"({self.heads}); give head_dim")
        if self.implementation not in IMPLEMENTATIONS:
            raise CostModelError(f"model {self.name!r}: implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                                 f"got {self.implementation!r}")
        for field in ("experts", "active_experts", "expert_ffn", "shared_ffn"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CostModelError(f"model {self.name!r}: {field} must be a whole number >= 0, got {value!r}")
        kinds = check_runs(self.kinds, self.layers, self.name)
        if self.experts and not any(kind.moe for kind, _ in kinds):
            if kinds:
                raise CostModelError(f"model {self.name!r}: {self.experts} experts but no layer kind is MoE "
                                     f"(LayerKind(moe=True))")
            kinds = ((LayerKind(moe=True), self.layers),) if self.layers else ()
        object.__setattr__(self, "kinds", kinds)
        if any(kind.moe for kind, _ in kinds):
            if not self.experts:
                raise CostModelError(f"model {self.name!r}: MoE layers need experts >= 1, got {self.experts}")
            if not 1 <= self.active_experts <= self.experts:
                raise CostModelError(f"model {self.name!r}: active_experts must be 1 to experts ({self.experts}), "
                                     f"got {self.active_experts}")
        elif self.active_experts or self.shared_ffn or self.expert_ffn:
            raise CostModelError(f"model {self.name!r}: active_experts/expert_ffn/shared_ffn given but no layer is "
                                 f"MoE; give experts (and MoE layer kinds)")
        if self.latent is not None and not isinstance(self.latent, LatentShape):
            raise CostModelError(f"model {self.name!r}: latent must be a LatentShape, got {self.latent!r}")
        if self.latent is not None and self.head_size != self.latent.nope + self.latent.rope:
            raise CostModelError(f"model {self.name!r}: latent attention's q/k head is nope + rope = "
                                 f"{self.latent.nope + self.latent.rope}, but head_dim is {self.head_size}")
        if self.linear is not None and not isinstance(self.linear, LinearShape):
            raise CostModelError(f"model {self.name!r}: linear must be a LinearShape, got {self.linear!r}")

    # --- widths -------------------------------------------------------------------------------
    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of Q (and of the attention output) per token: heads x head size."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of K (or V) per token: kv heads x head size (``hidden * kv_heads / heads`` without head_dim)."""
        return self.kv_heads * self.head_size

    @property
    def v_head_size(self) -> int:
        """Width of one head's v and output: the head size, except in latent attention (``latent.v_dim``)."""
        return self.latent.v_dim if self.latent is not None else self.head_size

    @property
    def attention_width(self) -> float:
        """Multiply-adds per attention pair per layer over QK^T and PV, halved: ``q_dim`` for plain attention."""
        return self.heads * (self.head_size + self.v_head_size) / 2

    @property
    def ulysses_width(self) -> int:
        """Elements one token sends per softmax layer in Ulysses' all-to-alls: q, k, v in and the output back."""
        return self.q_dim + self.kv_dim + self.kv_heads * self.v_head_size + self.heads * self.v_head_size

    @property
    def ring_width(self) -> int:
        """Elements of K and V one token passes around a ring per softmax layer: K and V travel stacked, so a
        latent attention's narrower v is padded to the q/k head size (``flexsp.runtime.sp.ring``)."""
        return 2 * self.kv_dim

    @property
    def linear_shape(self) -> LinearShape:
        """The linear-attention heads (``linear``, else the attention's heads and head size)."""
        return self.linear or LinearShape(self.heads, self.heads, self.head_size, self.head_size)

    @property
    def moe_ffn(self) -> int:
        return self.expert_ffn or self.ffn

    # --- layers -------------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """One ``LayerKind`` per layer, in order (the runs expanded; the records are shared, not copied)."""
        if not self.kinds:
            return (FULL,) * self.layers
        return tuple(kind for kind, count in self.kinds for _ in range(count))

    def with_layers(self, layers: int) -> "ModelSpec":
        """The same model with ``layers`` layers (profiling and tests run a few): its first ``layers`` layer
        kinds, the pattern repeated where it asks for more; experts kept while a layer is still MoE."""
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise CostModelError(f"model {self.name!r}: layers must be an integer >= 0, got {layers!r}")
        per_layer = self.layer_kinds
        kinds = runs(per_layer[i % len(per_layer)] for i in range(layers)) if per_layer else ()
        moe = any(kind.moe for kind, _ in kinds)
        experts = {} if moe else dict(experts=0, active_experts=0, expert_ffn=0, shared_ffn=0)
        return dataclasses.replace(self, layers=layers, kinds=kinds, **experts)

    def kind_counts(self) -> dict[LayerKind, int]:
        """Layers of each distinct kind (what the cost and memory models sum over)."""
        out: dict[LayerKind, int] = {}
        for kind, count in self.kinds or ((FULL, self.layers),):
            if count:
                out[kind] = out.get(kind, 0) + count
        return out

    def mixer_layers(self, mixer: str, size: int | None = None) -> int:
        """Layers whose mixer is ``mixer`` (and whose size is ``size``, where given)."""
        return sum(n for k, n in self.kind_counts().items() if k.mixer == mixer and (size is None or k.size == size))

    @property
    def softmax_layers(self) -> int:
        """Layers with softmax attention (full, window, chunk): those that move K/V and keep flash activations."""
        return sum(n for k, n in self.kind_counts().items() if k.softmax)

    @property
    def is_dense_full(self) -> bool:
        """Every layer full attention with a dense FFN: the model every spec was before layer kinds."""
        return all(k.mixer == "full" and not k.moe for k in self.kind_counts())

    @property
    def ulysses_heads(self) -> int:
        """Heads every mixer can split by: the attention's, and the linear layers' key and value heads."""
        heads = self.heads
        if self.mixer_layers("linear"):
            shape = self.linear_shape
            heads = math.gcd(heads, shape.k_heads, shape.v_heads)
        return heads

    # --- parameters ---------------------------------------------------------------------------
    def _mixer_params(self, kind: LayerKind) -> float:
        if kind.softmax:
            gate = self.hidden * self.q_dim if self.attn_gate else 0
            if self.latent is not None:
                return self.latent.params(self.hidden, self.heads) + gate
            return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden + gate
        shape = self.linear_shape
        k, v = shape.key_width, shape.value_width   # in-projections q, k, v, z, b, a; conv over q, k, v; out
        return self.hidden * (2 * k + 2 * v + 2 * shape.v_heads) + shape.conv * (2 * k + v) + v * self.hidden

    def _ffn_params(self, kind: LayerKind, active: bool) -> float:
        if not kind.moe:
            return (3 if self.gated_ffn else 2) * self.hidden * self.ffn
        experts = self.active_experts if active else self.experts
        return self.hidden * self.experts + 3 * self.hidden * (experts * self.moe_ffn + self.shared_ffn)

    def _params(self, active: bool) -> float:
        blocks = sum(n * (self._mixer_params(k) + self._ffn_params(k, active)) for k, n in self.kind_counts().items())
        heads = 1 if self.tie_embeddings else 2
        return blocks + heads * self.hidden * self.vocab

    @property
    def params(self) -> float:
        """Every parameter (all experts): what model states (master, gradients, optimizer) hold. Norms excluded."""
        return self._params(active=False)

    @property
    def active_params(self) -> float:
        """Parameters one token uses (its ``active_experts`` of each MoE layer); ``params`` for dense models."""
        return self._params(active=True)

    @property
    def linear_params(self) -> float:
        """Weights each token multiplies (active experts only; embedding lookup excluded, LM head included)."""
        return self.active_params - (0 if self.tie_embeddings else self.hidden * self.vocab)

    def mixing_flops_per_token(self) -> float:
        """Forward FLOPs per token of the linear-attention recurrences, all layers (0 without linear layers)."""
        return self.mixer_layers("linear") * self.linear_shape.mixing_flops_per_token()

    def attention_pairs(self, lengths) -> float:
        """Sum over layers and sequences of ``flexsp.plan.layers.pairs``: ``layers x s^2`` for a dense model."""
        s = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths), dtype=np.float64)
        return float(sum(n * pairs(s, k.mixer, k.size).sum() for k, n in self.kind_counts().items() if k.softmax))

    def training_flops(self, lengths: Iterable[int]) -> float:
        """Forward + backward FLOPs of a step over sequences of ``lengths`` tokens: ``6 x linear_params`` per
        token, and per sequence of ``s`` tokens causal attention's ``6 x attention_width x pairs`` (``heads x
        head_size``; latent attention averages its q/k and v widths)
        (``s^2`` per full layer, less for windows and chunks: ``flexsp.plan.layers.pairs``; QK^T and PV, 2 FLOPs
        a multiply-add, half the square, three passes), plus 3x the linear-attention recurrences' forward
        FLOPs. The one count behind MFU (``flexsp.telemetry``), the selftest's TFLOP/s and the profile's sweep
        estimate."""
        s = np.asarray(lengths if isinstance(lengths, np.ndarray) else list(lengths), dtype=np.float64)
        tokens = float(s.sum())
        return (6.0 * self.linear_params * tokens + 6.0 * self.attention_width * self.attention_pairs(s)
                + 3.0 * self.mixing_flops_per_token() * tokens)

    def shape(self) -> dict[str, Any]:
        """The six shape fields and the name: what a cost model records as ``meta["model"]``; a model with
        layer kinds or experts adds ``layer_kinds`` (counts by kind) and ``active_params``."""
        out = {**{f: getattr(self, f) for f in SHAPE_FIELDS}, "name": self.name}
        if not self.is_dense_full:
            out["layer_kinds"] = {k.describe(): n for k, n in self.kind_counts().items()}
            out["params"], out["active_params"] = self.params, self.active_params
        return out


IMPLEMENTATIONS = ("flexsp", "transformers")


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
    """The shape of a transformers config (its text part for multimodal ones): the one HF -> spec conversion.

    Layer kinds come from ``layer_types`` (``full_attention``, ``sliding_attention`` with ``sliding_window``,
    ``chunked_attention`` with ``attention_chunk_size``, ``linear_attention`` with the ``linear_*`` head
    fields), else from ``sliding_window`` (every layer windowed: Mistral, Mixtral); NoPE layers from
    ``no_rope_layers``; sinks for GPT-OSS. Experts from ``num_local_experts`` / ``num_experts`` /
    ``n_routed_experts`` and ``num_experts_per_tok``; which layers are MoE from ``moe_layers`` (Llama 4),
    ``first_k_dense_replace`` (DeepSeek-V3) or ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen MoE)."""
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    heads = int(text.num_attention_heads)
    family = str(getattr(text, "model_type", "llama"))
    name = name or f"hf:{family}:{getattr(config, 'name_or_path', '') or 'config'}"
    per_layer = getattr(text, "per_layer_attributes", None)   # transformers' heterogeneous configs (Gemma 4)
    if per_layer:
        raise CostModelError(f"model {name!r}: its layers differ in {sorted(map(str, per_layer))} (transformers' "
                             f"per_layer_config: Gemma 4's full layers have their own head size); a ModelSpec has "
                             f"one attention shape, so FlexSP cannot describe {family} yet")
    head_dim = getattr(text, "head_dim", None)
    latent = None
    if getattr(text, "kv_lora_rank", None) is not None:          # DeepSeek MLA: q/k heads of nope + rope dims
        nope, rope = int(text.qk_nope_head_dim or 0), int(getattr(text, "qk_rope_head_dim", 0) or 0)
        latent = LatentShape(int(getattr(text, "q_lora_rank", 0) or 0), int(text.kv_lora_rank), nope, rope,
                             int(getattr(text, "v_head_dim", None) or nope + rope))
        head_dim = nope + rope
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    experts = int(_first(text, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") or 0)   # Aria: moe_
    moe_layers = _moe_layers(text, layers, name) if experts else set()
    ffn = int(_first(text, "intermediate_size_mlp", "intermediate_size") or 4 * hidden)
    expert_ffn = int(_first(text, "moe_intermediate_size", "intermediate_size") or 0) if experts else 0
    shared_ffn = 0
    if experts:
        # the always-active experts' width: named outright (Qwen MoE, MiniMax-M3), or a count of experts as wide as
        # a routed one (DeepSeek n_, AfMoE/EXAONE/HY num_, Ernie moe_num_); Aria's are as wide as its dense FFN
        shared_ffn = int(_first(text, "shared_expert_intermediate_size", "shared_intermediate_size") or 0)
        count = int(_first(text, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts") or 0)
        shared_ffn = shared_ffn or count * (int(text.intermediate_size) if family.startswith("aria") else expert_ffn)
        if family.startswith("llama4"):                            # one shared expert as wide as a routed one
            shared_ffn = expert_ffn
    kinds = [_hf_kind(text, i, name, family, i in moe_layers) for i in range(layers)]
    active = int(_first(text, "num_experts_per_tok", "moe_topk") or 0) if moe_layers else 0
    if family.startswith("llama4") and moe_layers:
        active = experts   # transformers' Llama4TextMoe runs every expert on every token (scores zero the rest)
    linear = None
    if any(k.mixer == "linear" for k in kinds):
        fields_ = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        missing = [f for f in fields_ if getattr(text, f, None) is None]
        if missing:   # Jamba, Bamba, MiniMax, Kimi-Linear...: linear layers of another kind than Gated DeltaNet
            raise CostModelError(f"model {name!r}: its linear_attention layers have no {', '.join(missing)}; FlexSP's "
                                 f"linear-attention cost covers Gated DeltaNet (Qwen3-Next, Qwen3.5), not {family}'s")
        linear = LinearShape(int(text.linear_num_key_heads), int(text.linear_num_value_heads),
                             int(text.linear_key_head_dim), int(text.linear_value_head_dim),
                             int(getattr(text, "linear_conv_kernel_dim", 4) or 4))
    kv_heads = int(_first(text, "num_key_value_heads", "num_kv_heads") or heads)   # Falcon-40B: num_kv_heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1                                               # Falcon-7B's multi-query attention
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=int(text.vocab_size), name=name, family=family,
                     head_dim=None if head_dim is None or int(head_dim) * heads == hidden else int(head_dim),
                     tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     kinds=runs(kinds), experts=experts if moe_layers else 0,
                     active_experts=active,
                     expert_ffn=expert_ffn if moe_layers and expert_ffn != ffn else 0,
                     shared_ffn=shared_ffn if moe_layers else 0, linear=linear, implementation="transformers",
                     attn_gate=family.startswith(("qwen3_next", "qwen3_5")),
                     qk_norm=family.startswith(_QK_NORM_FAMILIES) or bool(getattr(text, "use_qk_norm", False)),
                     latent=latent, gated_ffn=family not in _PLAIN_MLP_FAMILIES)


# transformers families whose MLP is two matrices (up, activation, down), not gated: their parameters, FLOPs and
# model states would read 1.3-1.6x high as gate-up-down
_PLAIN_MLP_FAMILIES = frozenset((
    "apertus", "arcee", "biogpt", "bloom", "codegen", "falcon", "fuyu", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo",
    "gpt_neox", "gpt_neox_japanese", "gptj", "jais2", "mpt", "nanochat", "nemotron", "openai-gpt", "opt", "persimmon",
    "phi", "starcoder2", "xglm"))

# transformers families whose attention normalises q and k per head (their modeling files' q_norm / k_norm)
_QK_NORM_FAMILIES = ("qwen3", "gemma3", "olmo2", "olmo3")


_HF_MIXERS = {"full_attention": "full", "sliding_attention": "window", "chunked_attention": "chunk",
              "linear_attention": "linear"}


def _first(config: Any, *names: str) -> Any:
    """The first of ``names`` the config sets (not None)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


_SPARSE_MLPS, _DENSE_MLPS = ("sparse", "moe", "hash_moe"), ("dense",)   # transformers' mlp_layer_types entries


def _moe_layers(text: Any, layers: int, name: str) -> set[int]:
    """The layers whose FFN is routed experts, by each family's own rule in transformers."""
    kinds = getattr(text, "mlp_layer_types", None)
    if kinds is not None:                                                  # GLM-4-MoE-Lite, Laguna, EXAONE-MoE, ...
        unknown = sorted({str(k) for k in kinds} - set(_SPARSE_MLPS) - set(_DENSE_MLPS))
        if unknown or len(kinds) != layers:
            raise CostModelError(f"model {name!r}: mlp_layer_types must list {layers} of {_SPARSE_MLPS + _DENSE_MLPS}, "
                                 f"got {len(kinds)} entries" + (f" with {unknown}" if unknown else ""))
        moe = {i for i, k in enumerate(kinds) if k in _SPARSE_MLPS}
    elif getattr(text, "moe_layers", None) is not None:                    # Llama 4
        moe = {int(i) for i in text.moe_layers}
    elif getattr(text, "first_k_dense_replace", None) is not None:         # DeepSeek-V3
        moe = set(range(int(text.first_k_dense_replace), layers))
    elif getattr(text, "num_dense_layers", None) is not None:              # AfMoE
        moe = set(range(int(text.num_dense_layers), layers))
    elif getattr(text, "moe_layer_interval", None) is not None:            # Ernie 4.5 MoE
        start, end = int(text.moe_layer_start_index or 0), getattr(text, "moe_layer_end_index", None)
        end = layers - 1 if end is None or int(end) < 0 else int(end)
        moe = {i for i in range(layers) if (i + 1) % int(text.moe_layer_interval) == 0 and start <= i <= end}
    else:
        dense = {int(i) for i in (getattr(text, "mlp_only_layers", None) or ())}
        if any(not 0 <= i < layers for i in dense):
            raise CostModelError(f"model {name!r}: mlp_only_layers {sorted(dense)} name layers outside 0..{layers - 1}")
        step = getattr(text, "decoder_sparse_step", 1)                      # Qwen MoE
        step = 1 if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise CostModelError(f"model {name!r}: decoder_sparse_step must be an integer >= 1, got {step!r}")
        moe = {i for i in range(layers) if i not in dense and (i + 1) % step == 0}
    if moe and _first(text, "num_experts_per_tok", "moe_topk") is None:
        raise CostModelError(f"model {name!r}: MoE layers with routed experts but num_experts_per_tok is not set")
    return moe


def _hf_kind(text: Any, i: int, name: str, family: str, moe: bool) -> LayerKind:
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is not None:
        if len(types) != int(text.num_hidden_layers):
            raise CostModelError(f"model {name!r}: layer_types lists {len(types)} layers but the config has "
                                 f"{text.num_hidden_layers}")
        mixer = _HF_MIXERS.get(types[i])
        if mixer is None:
            raise CostModelError(f"model {name!r}: layer {i} is {types[i]!r}, which FlexSP's cost model does not "
                                 f"know; known: {', '.join(_HF_MIXERS)}")
    else:
        mixer = "window" if window is not None else "full"
    size = 0
    if mixer == "window":
        size = window
        if size is None:
            raise CostModelError(f"model {name!r}: layer {i} is sliding_attention but sliding_window is not set")
    elif mixer == "chunk":
        size = getattr(text, "attention_chunk_size", None)
        if size is None:
            raise CostModelError(f"model {name!r}: layer {i} is chunked_attention but attention_chunk_size is not set")
    if isinstance(size, bool) or not isinstance(size, int) or (mixer in ("window", "chunk") and size <= 0):
        raise CostModelError(f"model {name!r}: layer {i} ({types[i] if types else mixer}) needs a window or "
                             f"chunk >= 1 token, got {size!r}")
    nope = getattr(text, "no_rope_layers", None)
    rope = bool(nope[i]) if nope is not None and i < len(nope) else True   # Llama 4: 1 = uses rope
    return LayerKind(mixer, int(size), sinks=family == "gpt_oss" and mixer != "linear", moe=moe, rope=rope)


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
    register_model(ModelSpec(**{**_HF_TINY, **_overrides}, name=f"hf-{_family}", family=_family,
                             implementation="transformers"))
# Models with layer kinds and experts (``flexsp.plan.layers``), shapes from their published configs; they
# have no measured constants: ``cost_from_preset`` serves them as analytic presets (``ANALYTIC_PRESETS``).
_WINDOW_128 = LayerKind("window", 128, sinks=True, moe=True)
register_model(ModelSpec(24, 2880, 64, 8, 2880, 201088, "gpt-oss-20b", family="gpt_oss", head_dim=64, norm_eps=1e-5,
                         kinds=runs([_WINDOW_128, LayerKind("full", sinks=True, moe=True)] * 12),
                         experts=32, active_experts=4, implementation="transformers"))
register_model(ModelSpec(62, 5376, 32, 16, 21504, 262208, "gemma-3-27b", family="gemma3_text", head_dim=128,
                         tie_embeddings=True, implementation="transformers", qk_norm=True,
                         kinds=runs(LayerKind("window", 1024) if (i + 1) % 6 else FULL for i in range(62))))
# Qwen3.5-27B's text decoder: 64 layers, 3 Gated DeltaNet layers (16 key, 48 value heads of 128) to 1 gated
# full-attention layer (24 heads, 4 KV heads of 256)
register_model(ModelSpec(64, 5120, 24, 4, 17408, 248320, "qwen3.5-27b", family="qwen3_5_text", head_dim=256,
                         implementation="transformers", linear=LinearShape(16, 48, 128, 128, 4), attn_gate=True,
                         qk_norm=True,
                         kinds=runs(([LayerKind("linear")] * 3 + [FULL]) * 16)))

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
