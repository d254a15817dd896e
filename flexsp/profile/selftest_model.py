"""What ``flexsp selftest`` runs its step checks on, and the memory it expects them to take.

* **Shape** (``--shape``): a registered ``ModelSpec`` name (``flexsp.plan.specs``), ``field=value`` pairs
  (``hidden``, ``layers``, ``heads``, ``kv_heads``, ``ffn``, ``vocab``: all six), or a name followed by
  pairs that override it: ``llama3-8b,layers=2`` (the CUDA default: a Llama-3-8B layer shape where the
  kernels and the LM head matter), ``hidden=256,layers=3,heads=4,kv_heads=2,ffn=688,vocab=4096`` (the CPU
  default: seconds in CI). With ``--hf-config`` the shape is the config's and only ``layers=N`` applies.
* **Vocabulary**: where the device cannot hold the selftest at that shape, the vocabulary (the LM head
  and embedding, most of a 2-layer model's parameters) is cut to the largest multiple of 128 that fits;
  the report says so. The layer shape, what the kernels see, never changes.
* **Model**: built the way the README's loop builds it: fp32 master weights prepared by
  ``flexsp.runtime.shard_model`` with ``TrainConfig(param_dtype=bf16)`` on CUDA (at world 1 that is the
  executor's autocast) or fp32 compute on the CPU; a ``TinyLM``, or the user's transformers model behind
  the HF adapter.
* **Memory budget**: what the capacity model (``flexsp.plan.memory``) sets aside for this configuration at
  world 1: ``state_bytes(params, 1, sharding)`` (fp32 master 4 B, gradients 4 B, Adam's two moments 8 B,
  the bf16 compute copy 2 B per parameter) plus ``activation_bytes_per_token x tokens`` (autocast: the
  world-1 precision path). The selftest's memory step runs AdamW so both sides count the same states.
  Its activation check compares activations with activations: what a forward leaves allocated, less the
  states a forward makes (``Budget.forward_states``: autocast's bf16 copies of the layers' weights, not of
  the embedding or the head, which are never cast; and the LM head's weight gradient, which the fused
  loss computes during the forward: fp32 from FlexSP's own loss, bf16 from liger-kernel's), against ``activation_bytes_per_token x`` the micro-batch's tokens.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from flexsp.errors import FlexSPError
from flexsp.plan.memory import StateBytes, activation_bytes_per_token, state_bytes
from flexsp.plan.specs import SHAPE_FIELDS, ModelSpec

CUDA_SHAPE = "llama3-8b,layers=2"
CPU_SHAPE = "hidden=256,layers=3,heads=4,kv_heads=2,ffn=688,vocab=4096"
CUDA_TOKENS, CPU_TOKENS = 8192, 1024
MIX = (2048, 1024, 512, 256, 256)     # relative sequence lengths of the step's batch (a long-tailed pack)
DEVICE_SHARE = 0.8                    # of the device's memory the selftest may plan to use
MIN_VOCAB = 8192


class SelftestError(FlexSPError):
    """A selftest option is malformed, or the device cannot hold the selftest at any vocabulary."""


def parse_shape(text: str, *, hf: bool = False) -> tuple[str | None, dict[str, int]]:
    """``--shape`` as (registry name or None, field overrides); see the module docstring for the syntax."""
    name, fields = None, {}
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if "=" not in part:
            if i:
                raise SelftestError(f"--shape {text!r}: a model name may only come first, got {part!r}")
            name = part
            continue
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in SHAPE_FIELDS:
            raise SelftestError(f"--shape {text!r}: unknown field {key!r}; valid: {', '.join(SHAPE_FIELDS)}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise SelftestError(f"--shape {text!r}: {key} must be a whole number, got {value!r}") from None
        if fields[key] < 1:
            raise SelftestError(f"--shape {text!r}: {key} must be >= 1, got {fields[key]}")
    if hf and (name is not None or set(fields) - {"layers"}):
        raise SelftestError(f"--shape {text!r} with --hf-config: the shape is the config's; only layers=N applies")
    return name, fields


def resolve_spec(text: str) -> ModelSpec:
    """The ``ModelSpec`` a ``--shape`` names (a registry entry, overridden, or all six fields)."""
    from flexsp.profile.shape import model_spec
    name, fields = parse_shape(text)
    try:
        return model_spec(name, **fields)
    except FlexSPError as exc:
        raise SelftestError(f"--shape {text!r}: {exc}") from None


@dataclass(frozen=True)
class Budget:
    """What the capacity model sets aside at world 1 for ``tokens`` tokens of ``spec`` (module docstring)."""

    states: StateBytes
    activation_per_token: float
    tokens: int
    sharding: str = "full"

    forward_states: float = 0.0   # states a forward makes (module docstring): weight copies, the head's gradient

    @property
    def activations(self) -> float:
        return self.activation_per_token * self.tokens

    @property
    def total(self) -> float:
        return self.states.total + self.activations

    def describe(self) -> str:
        s = self.states
        return (f"states {s.total / 2**20:.0f} MiB (master {s.params / 2**20:.0f}, grads {s.grads / 2**20:.0f}, "
                f"Adam {s.optimizer / 2**20:.0f}, bf16 copy {s.compute_copy / 2**20:.0f}) + activations "
                f"{self.activations / 2**20:.0f} MiB ({self.activation_per_token:.0f} B/token x {self.tokens})")


def budget(spec: ModelSpec, tokens: int, *, half: bool, sharding: str = "full", recompute: str = "none",
           head_grad_bytes: int = 4) -> Budget:
    """The capacity model's accounting of a world-1 step of ``spec`` on ``tokens`` tokens; ``half``: bf16
    compute (a 2-byte compute copy), else the parameters compute in fp32 (no copy). ``head_grad_bytes``: bytes
    per element of the LM head's weight gradient the loss makes during the forward - 4 for FlexSP's own loss
    (an fp32 accumulator), 2 for liger-kernel's, which hands back its gradient in the bf16 compute dtype
    (measured on an H200: with 4 assumed, the activations read 22% low)."""
    states = state_bytes(spec.params, 1, sharding, compute_bytes=2 if half else 0)
    embedding = spec.hidden * spec.vocab
    head = embedding                                   # the LM head's weight (the embedding's when tied)
    blocks = spec.params - embedding - (0 if spec.tie_embeddings else head)
    made = (2 * blocks if half else 0) + head_grad_bytes * head
    return Budget(states, activation_bytes_per_token(spec, recompute, "autocast"), tokens, sharding, made)


def selftest_bytes(spec: ModelSpec, tokens: int, longest: int, half: bool) -> float:
    """Device bytes the whole selftest needs at once: during the step check the executor's model, the plain
    loop's copy and the starting weights (fp32, each with fp32 gradients but the last), activations, and the
    plain loop's full logits of its longest sequence; the memory check after it needs the budget."""
    p = spec.params
    step = 3 * 4 * p + 2 * 4 * p + (2 * p if half else 0) + budget(spec, tokens, half=half).activations \
        + longest * spec.vocab * (2 + 4 + 4)
    return max(step, budget(spec, tokens, half=half).total)


def fit_vocab(spec: ModelSpec, tokens: int, longest: int, half: bool, memory_bytes: float) -> tuple[ModelSpec, str]:
    """``spec``, its vocabulary cut (largest multiple of 128) where ``DEVICE_SHARE`` of ``memory_bytes``
    cannot hold the selftest; and a note for the report ('' when nothing was cut)."""
    room = DEVICE_SHARE * memory_bytes
    if selftest_bytes(spec, tokens, longest, half) <= room:
        return spec, ""
    lo, hi = MIN_VOCAB // 128, spec.vocab // 128   # in units of 128; needs shrink with the vocabulary

    def fits(units: int) -> bool:
        return selftest_bytes(dataclasses.replace(spec, vocab=units * 128), tokens, longest, half) <= room
    if hi < lo or not fits(lo):
        raise SelftestError(f"the selftest at shape {spec.name} ({spec.params / 1e9:.2f} B params, {tokens} tokens) "
                            f"needs {selftest_bytes(spec, tokens, longest, half) / 2**30:.1f} GiB, more than "
                            f"{DEVICE_SHARE:.0%} of this device's {memory_bytes / 2**30:.1f} GiB even with a "
                            f"{MIN_VOCAB}-token vocabulary; pick a smaller --shape or --tokens")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    cut = dataclasses.replace(spec, vocab=lo * 128)
    return cut, (f"vocabulary cut from {spec.vocab} to {cut.vocab} (largest multiple of 128 whose selftest fits "
                 f"{DEVICE_SHARE:.0%} of the device's {memory_bytes / 2**30:.1f} GiB; layer shape unchanged)")


@dataclass(frozen=True)
class Built:
    """The selftest's models: ``flex`` prepared for the executor, ``plain`` its copy for the plain loop,
    ``plain_loss(model, sequences)`` that loop's mean next-token loss, ``spec`` the shape, ``kind`` what
    was built (TinyLM or the HF model's name)."""

    flex: Any
    plain: Any
    base: Any
    plain_loss: Callable[[Any, list], Any]
    spec: ModelSpec
    kind: str


def build(torch, spec: ModelSpec, device, *, half: bool, hf_config: Any = None, max_seqlen: int | None = None,
          seed: int = 0) -> Built:
    """The executor's model (``shard_model`` with ``param_dtype`` bf16 when ``half``), the plain loop's copy
    and the starting weights, all fp32 on ``device``. Needs a process group (a world of one will do)."""
    from flexsp.runtime.config import TrainConfig
    from flexsp.runtime.fsdp import shard_model

    torch.manual_seed(seed)
    if hf_config is None:
        from flexsp.runtime.models.plain import plain_loss
        from flexsp.runtime.models.tiny import TinyLM
        with torch.device(device):   # initialised where it runs: no host copy of the weights
            base = TinyLM(spec)
        kind, loss = "TinyLM", plain_loss
    else:
        from flexsp.hf.prepare import from_config
        base = from_config(hf_config, dtype=torch.float32, device=device, max_seqlen=max_seqlen)
        kind, loss = base.name, _hf_plain_loss
    flex = shard_model(copy.deepcopy(base), TrainConfig(param_dtype=torch.bfloat16 if half else None))
    return Built(flex=flex, plain=copy.deepcopy(base), base=base, plain_loss=loss, spec=spec, kind=kind)


def hf_config_for(source: str, layers: int | None, vocab: int | None = None):
    """The user's transformers config with ``layers`` decoder layers and, where cut, ``vocab`` tokens."""
    from flexsp.hf.prepare import load_config, with_layers
    cfg = load_config(source)
    cfg = with_layers(cfg, layers) if layers is not None else copy.deepcopy(cfg)
    if vocab is not None:
        getter = getattr(cfg, "get_text_config", None)
        (getter() if callable(getter) else cfg).vocab_size = vocab
    return cfg


def _hf_plain_loss(adapter, sequences):
    """The plain loop for a transformers model: the model itself, once per sequence (SDPA's ``is_causal``)."""
    import torch.nn.functional as F

    from flexsp.runtime.models.protocol import loss_dtype
    labels = sum(max(0, int(s.numel()) - 1) for s in sequences)
    losses = []
    for s in sequences:
        logits = adapter.model(input_ids=s[None], use_cache=False).logits[0, :-1]
        losses.append(F.cross_entropy(logits.to(loss_dtype(logits.dtype)), s[1:], reduction="sum"))
    return sum(losses) / labels
