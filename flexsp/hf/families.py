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
            attn_pdrop=0.0, dropout=0.0, n_embd=32, n_layer=2, n_head=4, n_positions=512, d_model=32, n_inner=48,
            ffn_dim=48, num_layers=2, num_heads=4, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
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


def tiny_config(model_type: str) -> Any:
    from transformers import AutoConfig
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config() if hasattr(base, "get_text_config") else base
    if text is not base:
        raise _Skip("composite config (a text config inside a multimodal one)")
    kwargs = {k: v for k, v in TINY.items() if k in text.to_dict() or hasattr(text, k)}
    # every dropout and noise off: the comparison is deterministic (attention dropout is refused by features.py anyway)
    kwargs.update({k: 0.0 for k, v in text.to_dict().items() if ("dropout" in k or "pdrop" in k or "jitter" in k)
                   and isinstance(v, float)})   # router jitter noise (PhiMoE) too
    cfg = AutoConfig.for_model(model_type, **kwargs)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:int(getattr(cfg, "num_hidden_layers", 2))]
    return cfg


class _Skip(Exception):
    pass


def tiny_model(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny fp64 random-init instance of ``model_type`` (same seed, same weights on every rank)."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(cfg)
    size = sum(p.numel() for p in probe.parameters())
    if size > MAX_PARAMS:
        raise _Skip(f"does not shrink below {MAX_PARAMS:,} parameters from its config ({size:,})")
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, TypeError):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.double().train()


def batch(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def has_router_loss(model_type: str) -> bool:
    """Whether the family's config has a router auxiliary loss it adds when ``output_router_logits``."""
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.for_model(model_type)
    except Exception:
        return False
    return hasattr(cfg, "output_router_logits") and bool(getattr(cfg, "router_aux_loss_coef", 0)
                                                        or getattr(cfg, "router_z_loss_coef", 0))


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
    as one padded batch instead, so that its router auxiliary loss covers the whole batch's tokens as
    it does in native training (HF's loss then averages over the batch's labelled tokens)."""
    with fp64_softmax():
        return _native_step(model, sequences)


def _native_step(model: torch.nn.Module, sequences: Sequence[torch.Tensor]) -> tuple[float, torch.Tensor]:
    if getattr(model.config, "output_router_logits", False):
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        labels = torch.full((len(sequences), width), -100)
        for i, s in enumerate(sequences):
            ids[i, :len(s)], mask[i, :len(s)], labels[i, :len(s)] = s, 1, s
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        with torch.no_grad():
            vec = torch.cat([(p - LR * (p.grad if p.grad is not None else torch.zeros_like(p))).reshape(-1)
                             for p in model.parameters() if p.requires_grad])
        return float(out.loss.detach()), vec
    denominator = sum(len(s) - 1 for s in sequences)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for s in sequences:
        logits = model(input_ids=s[None], use_cache=False).logits[0, :-1]
        loss = F.cross_entropy(logits.double(), s[1:], reduction="sum") / denominator
        loss.backward()
        total += float(loss.detach())
    with torch.no_grad():
        vec = torch.cat([(p - LR * (p.grad if p.grad is not None else torch.zeros_like(p))).reshape(-1)
                         for p in model.parameters() if p.requires_grad])
    return total, vec


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
    got = torch.cat([p.detach().reshape(-1) for p in sp.parameters() if p.requires_grad])
    loss_rel = abs(result.loss - want_loss) / max(abs(want_loss), 1e-300)
    update_rel = float((got - want).abs().max() / (want.abs().max() + 1e-300)) if got.shape == want.shape else math.inf
    ok = loss_rel <= RTOL and update_rel <= RTOL
    return FamilyResult(model_type, "exact" if ok else "MISMATCH", "" if ok else "loss or update differs from native",
                        loss_rel, update_rel, wrapped=bool(sp.routed))
