"""Every causal-LM family of the installed transformers: trains exactly under FlexSP, or is refused by name.

``causal_lm_types()`` reads transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
``tiny_model(model_type)`` random-initialises a tiny fp64 instance from the family's default config
shrunk to a few layers and heads (or says why it cannot: composite configs, a size that does not
shrink). ``check_family`` runs one optimizer step of it under a heterogeneous plan on this world
(``StepExecutor.run_plan``, SGD) and compares the loss and the updated parameters with the native
model run one sequence at a time (its own maths, no packing assumed). The outcome is one of:

- ``exact``: loss and update within ``RTOL`` of native;
- ``refused``: ``prepare_model`` raised ``UnsupportedModelError`` (before any collective) - the reason;
- ``skipped``: not instantiable tiny on CPU in fp64 (the reason);
- ``MISMATCH`` / ``ERROR``: a failure of FlexSP's promise (listed in the table, never hidden).

``experiments/hf_families.py`` runs it for every family on 4 gloo ranks and writes docs/hf_families.md.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from flexsp.hf.features import UnsupportedModelError
from flexsp.plan.types import Group, MicroBatch, Plan

RTOL = 1e-7          # relative error of the loss and of the update (max-norm), fp64 weights
LR = 0.5
MAX_PARAMS = 5_000_000
LENGTHS = (9, 17, 5, 12, 3, 7, 11, 6)
WINDOW = 4           # tiny sliding window and attention chunk, where a family has them
VOCAB = 128
# The shrink: config attributes set when the family's config has them (names differ per family).
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
            max_position_embeddings=512, attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, dropout=0.0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
            n_embd=32, n_layer=2, n_head=4, n_positions=512, d_model=32, n_inner=48,
            ffn_dim=48, num_layers=2, num_heads=4, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,   # latent attention: v narrower than q/k, as in DeepSeek-V3
            n_group=1, topk_group=1,                                # DeepSeek-V3's expert groups: 4 experts in one
            sliding_window=WINDOW, attention_chunk_size=WINDOW)   # shorter than most LENGTHS: windows and chunks bind


@dataclass(frozen=True)
class FamilyResult:
    model_type: str
    status: str            # exact | refused | skipped | MISMATCH | ERROR
    detail: str = ""
    loss_rel: float | None = None
    update_rel: float | None = None
    wrapped: bool = False  # its decoder layers drop **kwargs; FlexSP routes the context by hooks


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def heterogeneous_plan(world: int = 4) -> Plan:
    """Degrees 4, 2 and 1 side by side over ``LENGTHS``; ranks 2 and 3 idle in the last micro-batch."""
    if world != 4:
        raise ValueError("the family plan is written for 4 ranks")
    mb = lambda *gs: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in gs))  # noqa: E731
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=(
        mb(((0, 1, 2, 3), (1, 3))), mb(((0, 1), (0, 4)), ((2,), (5,)), ((3,), (2, 6))), mb(((0, 1), (7,)))))


# The shrink of a composite model's other towers (vision, audio): built and frozen, never run on text.
TOWER = dict(depth=1, num_hidden_layers=1, num_global_layers=1, hidden_size=32, intermediate_size=48, num_heads=4,
             num_attention_heads=4, attention_heads=4, num_key_value_heads=4, head_dim=8, out_hidden_size=32,
             vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def _shrink(config: Any, table: dict) -> dict:
    """``table``'s keys that ``config`` has, with every dropout and noise off (a deterministic comparison;
    attention dropout is refused by features.py anyway; router jitter noise, PhiMoE's, too)."""
    values = config.to_dict()
    kwargs = {k: v for k, v in table.items() if k in values or hasattr(config, k)}
    kwargs.update({k: 0.0 for k, v in values.items() if ("dropout" in k or "pdrop" in k or "jitter" in k)
                   and isinstance(v, float)})
    layers, new = values.get("num_hidden_layers"), kwargs.get("num_hidden_layers")
    if isinstance(layers, int) and isinstance(new, int) and new < layers:   # per-layer settings of the kept layers
        keep = _kept_layers(values.get("layer_types"), layers, new)
        for k, v in values.items():
            if isinstance(v, list) and len(v) == layers and k not in kwargs:
                kwargs[k] = [v[i] for i in keep]
            elif k.startswith("per_layer") and isinstance(v, dict) and all(str(i).isdigit() for i in v):
                kwargs[k] = {type(i)(j): v[i] for i in v for j, old in enumerate(keep) if int(i) == old}
    if "qk_rope_head_dim" in values:   # latent attention: head_dim names its rotary part, and every head has its k/v
        if "head_dim" in kwargs:
            kwargs["head_dim"] = TINY["qk_rope_head_dim"]
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    rope = values.get("rope_parameters")
    if "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()) and isinstance(rope, dict) \
            and "partial_rotary_factor" not in rope:   # mRoPE (t, h, w) sections summing to the rotary half-dimension
        half = (TINY["head_dim"] if "head_dim" in values else TINY["hidden_size"] // TINY["num_attention_heads"]) // 2
        kwargs["rope_parameters"] = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    vocab = kwargs.get("vocab_size")
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):   # special tokens inside the shrunk vocabulary
        if isinstance(vocab, int) and isinstance(values.get(k), int) and values[k] >= vocab:
            kwargs[k] = vocab - 1
    return kwargs


def _kept_layers(layer_types: Any, layers: int, new: int) -> list[int]:
    """Which ``new`` of ``layers`` layers a shrunk config keeps: the first of each layer kind (a hybrid's
    linear and full attention both), then the earliest others, in order."""
    keep: list[int] = []
    if isinstance(layer_types, list) and len(layer_types) == layers:
        firsts = {}
        for i, kind in enumerate(layer_types):
            firsts.setdefault(str(kind), i)
        keep = sorted(firsts.values())[:new]
    keep += [i for i in range(layers) if i not in keep][:new - len(keep)]
    return sorted(keep)


def tiny_config(model_type: str) -> Any:
    """The family's default config shrunk; a composite (multimodal) one has its text config shrunk as a causal
    LM's and its other towers to one tiny block each."""
    from transformers import AutoConfig
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    if text is base:
        return AutoConfig.for_model(model_type, **_shrink(text, TINY))
    subs = {}
    for name in getattr(type(base), "sub_configs", {}):
        sub = getattr(base, name, None)
        if sub is None:
            continue
        subs[name] = {**sub.to_dict(), **_shrink(sub, TINY if sub is text else TOWER)}
    return AutoConfig.for_model(model_type, **subs)


class _Skip(Exception):
    pass


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny fp64 random-init instance of ``model_type`` (same seed, same weights on every rank)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
        if cfg.get_text_config() is not cfg:   # a composite's language model reads its text config
            setattr(cfg.get_text_config(), k, v)
    auto = AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    with torch.device("meta"):
        probe = auto.from_config(cfg)
    size = sum(p.numel() for p in probe.parameters())
    if size > MAX_PARAMS:
        raise _Skip(f"does not shrink below {MAX_PARAMS:,} parameters from its config ({size:,})")
    torch.manual_seed(seed)
    try:
        model = auto.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, TypeError):
        torch.manual_seed(seed)
        model = auto.from_config(cfg, attn_implementation="eager")
    return model.double().train()


def batch(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def text_of(model: torch.nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def has_router_loss(model_type: str) -> bool:
    """Whether the family's config has a router auxiliary loss it adds when ``output_router_logits``."""
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.for_model(model_type)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except Exception:
        return False
    return hasattr(cfg, "output_router_logits") and bool(getattr(cfg, "router_aux_loss_coef", 0)
                                                        or getattr(cfg, "router_z_loss_coef", 0)
                                                        or getattr(cfg, "aux_loss_coef", 0))   # JetMoE's name


@contextlib.contextmanager
def fp64_softmax():
    """While open, ``F.softmax(x, dtype=torch.float32)`` of an fp64 ``x`` stays fp64: transformers' eager
    attention functions force a float32 softmax, which would leave the fp64 reference float32-rounded
    (~1e-7, the size of ``RTOL``). The maths is the model's; only the reference's rounding changes."""
    original = F.softmax

    def softmax(x, *args, dtype=None, **kwargs):
        if dtype == torch.float32 and isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            dtype = torch.float64
        return original(x, *args, dtype=dtype, **kwargs)

    F.softmax = softmax
    try:
        yield
    finally:
        F.softmax = original


def native_step(model: torch.nn.Module, sequences: Sequence[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """The unmodified model on the whole batch: mean next-token loss and the SGD-updated parameters.
    Run under ``fp64_softmax`` (the model's eager softmax in fp64, not float32).

    Sequences run one at a time (no packing assumed); a model with ``output_router_logits`` runs them
    as one right-padded batch with its attention mask instead, so that its router auxiliary loss covers
    the whole batch's real tokens as in native training: HF's own ``model(input_ids, attention_mask,
    labels)``, whose ``.loss`` is the mean next-token loss plus ``coef * aux_loss``. HF computes that LM
    loss from fp32-cast logits; the reference recomputes it in fp64 from the same logits (checked against
    HF's ``.loss`` to fp32 rounding) so that the comparison is not limited by HF's cast."""
    with fp64_softmax():
        return _native_step(model, sequences)


def _native_step(model: torch.nn.Module, sequences: Sequence[torch.Tensor]) -> tuple[float, torch.Tensor]:
    if getattr(model.config, "output_router_logits", False) or getattr(text_of(model), "output_router_logits", False):
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        labels = torch.full((len(sequences), width), -100)
        for i, s in enumerate(sequences):
            ids[i, :len(s)], mask[i, :len(s)], labels[i, :len(s)] = s, 1, s
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        from flexsp.hf.router import RouterLoss
        try:
            rule = RouterLoss.of(model)
        except UnsupportedModelError:   # a router loss FlexSP refuses: the reference is HF's own loss as it is
            out.loss.backward()
            return float(out.loss.detach()), _updated(model)
        aux = 0.0 if rule is None or out.aux_loss is None else rule.coef * out.aux_loss.to(torch.float64)
        lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).double(),
                             labels[:, 1:].reshape(-1), ignore_index=-100)
        loss = lm + aux
        mine, theirs = float(loss.detach()), float(out.loss.detach())
        if not abs(mine - theirs) <= 1e-5 * abs(theirs):
            raise RuntimeError(f"the fp64 reference {mine} is not HF's own loss {theirs}")
        loss.backward()
        out.loss = loss
        return float(out.loss.detach()), _updated(model)
    denominator = sum(len(s) - 1 for s in sequences)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in sequences:
        logits = model(input_ids=s[None], use_cache=False).logits[0, :-1]
        loss = F.cross_entropy(logits.double(), s[1:], reduction="sum") / denominator
        loss.backward()
        total += float(loss.detach())
    return total, _updated(model)


def _updated(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter after one SGD step (those without a gradient unchanged: a composite's other towers)."""
    with torch.no_grad():
        return torch.cat([(p - LR * (p.grad if p.grad is not None else torch.zeros_like(p))).reshape(-1)
                          for p in model.parameters()])


ROUTER = "+router-loss"   # suffix of a model type: the same family with output_router_logits=True


def check_family(model_type: str, pool: Any, plan: Plan | None = None,
                 overrides: dict[str, Any] | None = None) -> FamilyResult:
    """One family on this rank of the pool's world (call on every rank, same order).

    ``"<type>+router-loss"``: the family with ``output_router_logits=True`` (MoE training with its
    router auxiliary loss), checked against the native loss that includes it. ``overrides``: config
    attributes set on the tiny config (a short window, a chunk size, a logit scale...).
    """
    from flexsp.hf.prepare import prepare_model
    from flexsp.runtime.step import StepExecutor
    plan = plan or heterogeneous_plan(pool.world_size)
    sequences = batch()
    base, router = model_type.removesuffix(ROUTER), model_type.endswith(ROUTER)
    overrides = {**(overrides or {}), **({"output_router_logits": True} if router else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            native = tiny_model(base, **overrides)
            ours = tiny_model(base, **overrides)
        except _Skip as exc:
            return FamilyResult(model_type, "skipped", str(exc))
        except Exception as exc:   # the family cannot be built tiny on CPU
            return FamilyResult(model_type, "skipped", f"not instantiable tiny: {type(exc).__name__}: "
                                                       f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
        try:
            want_loss, want = native_step(native, sequences)
        except Exception as exc:
            return FamilyResult(model_type, "skipped", f"native model fails in fp64 on CPU: {type(exc).__name__}: "
                                                       f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
        try:
            sp = prepare_model(ours, max_seqlen=max(LENGTHS))
        except UnsupportedModelError as exc:
            return FamilyResult(model_type, "refused", str(exc))
        try:
            with StepExecutor(sp, torch.optim.SGD(sp.parameters(), lr=LR), pool, backend="sdpa",
                              failure_name=f"family-{model_type}") as executor:
                result = executor.run_plan(plan, sequences)
        except UnsupportedModelError as exc:
            return FamilyResult(model_type, "refused", f"(at the first step) {exc}", wrapped=bool(sp.routed))
        except Exception as exc:
            return FamilyResult(model_type, "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                                wrapped=bool(sp.routed))
    got = torch.cat([p.detach().reshape(-1) for p in sp.parameters()])
    loss_rel = abs(result.loss - want_loss) / max(abs(want_loss), 1e-300)
    update_rel = float((got - want).abs().max() / (want.abs().max() + 1e-300)) if got.shape == want.shape else math.inf
    ok = loss_rel <= RTOL and update_rel <= RTOL
    return FamilyResult(model_type, "exact" if ok else "MISMATCH", "" if ok else "loss or update differs from native",
                        loss_rel, update_rel, wrapped=bool(sp.routed))
