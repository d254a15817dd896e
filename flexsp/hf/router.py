"""A MoE router's load-balancing loss over the global batch, as transformers computes it for one padded batch.

transformers' ``load_balancing_loss_func`` (one copy per MoE family, the same maths in each) takes every
MoE layer's router logits of the whole batch and its attention mask and returns

    E * sum_e (count_e / N) * (prob_e / N)

where ``count_e`` is how many top-k slots chose expert ``e`` and ``prob_e`` the summed softmax
probability of ``e``, both over every layer and every real (unmasked) token, and ``N`` the number of
(layer, real token) rows; the causal LM adds ``coef`` times it to its loss. The counts are not
differentiable, so the loss splits exactly over shards: each shard adds ``coef * E * <count, prob_shard> /
N^2`` with the *global* ``count`` and ``N`` - one all-reduce of ``E + 1`` numbers (``statistics``) - and the
shards' terms sum to the whole batch's loss and gradient. Padding rows of a shard are excluded.

``RouterLoss.of(model)`` reads the family's coefficient, expert count and top-k from its own call of
``load_balancing_loss_func`` and refuses a family whose function is not that maths (compared with
Mixtral's, the reference copy) or that calls it differently.
"""
from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch
from torch import nn

from flexsp.hf.features import UnsupportedModelError, model_name, text_config

FUNCTION = "load_balancing_loss_func"
REFERENCE = "transformers.models.mixtral.modeling_mixtral"   # the copy every family's is compared with


@dataclass(frozen=True)
class RouterTerm:
    """One shard's router statistics (detached) and its differentiable summed probabilities."""

    rule: "RouterLoss"
    statistics: torch.Tensor    # [E + 1] float64: top-k counts per expert, then the rows (layer x real token)
    probs: torch.Tensor | None  # [E] summed router probabilities over this shard's real rows (None: no rows)

    def loss(self, total: torch.Tensor) -> torch.Tensor:
        """This shard's part of ``coef * aux`` given the batch's summed ``statistics`` (``total``)."""
        if self.probs is None:
            return total.new_zeros(())
        counts, rows = total[:-1], total[-1].clamp(min=1.0)
        r = self.rule
        return (r.coef * r.num_experts) * (counts.to(self.probs.dtype) * self.probs).sum() / (rows * rows).to(
            self.probs.dtype)


def router_flag(model: nn.Module) -> bool:
    """``output_router_logits`` as the family's forward reads it: from the text config (a multimodal MoE class's
    own config flag adds no loss there), which for a causal LM is its config."""
    return bool(getattr(text_config(model), "output_router_logits", False))


@dataclass(frozen=True)
class RouterLoss:
    """The router auxiliary loss of one model: ``coef * load_balancing_loss(..., num_experts, top_k)``."""

    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, model: nn.Module) -> "RouterLoss | None":
        """None when the model adds no router loss (``output_router_logits`` off or a zero coefficient);
        raises ``UnsupportedModelError`` for one whose loss FlexSP cannot reproduce."""
        cfg, name = text_config(model), model_name(model)
        if not router_flag(model):
            return None
        if getattr(cfg, "router_z_loss_coef", None):
            raise UnsupportedModelError(f"{name} adds a router z-loss (config.router_z_loss_coef="
                                        f"{cfg.router_z_loss_coef}), which FlexSP does not compute")
        call = _call_site(type(model))
        if call is None:   # the family's forward adds no router loss (Llama 4's): neither does FlexSP
            return None
        experts_expr, top_k_expr, coef_expr = call
        if not _same_maths(type(model)):
            raise UnsupportedModelError(
                f"{name}: its {FUNCTION} is not the standard Switch-style load-balancing loss FlexSP splits over "
                f"SP groups (it differs from {REFERENCE}'s); set config.output_router_logits=False")
        coef = float(_resolve(model, coef_expr))
        if coef == 0.0:
            return None
        return cls(num_experts=int(_resolve(model, experts_expr)), top_k=int(_resolve(model, top_k_expr)), coef=coef)

    def term(self, router_logits: Sequence[torch.Tensor] | None, real: torch.Tensor) -> RouterTerm:
        """This shard's term from every MoE layer's router logits (``[tokens, E]`` each, this shard's
        rows in order) and ``real`` (bool ``[tokens]``: which rows are data, not padding)."""
        E = self.num_experts
        counts = torch.zeros(E, dtype=torch.float64, device=real.device)
        rows = torch.zeros((), dtype=torch.float64, device=real.device)
        probs = None
        for logits in router_logits or ():
            logits = logits.reshape(-1, logits.shape[-1])
            if logits.shape != (real.numel(), E):
                raise UnsupportedModelError(f"router logits of shape {tuple(logits.shape)} for a shard of "
                                            f"{real.numel()} tokens and {E} experts: not one row per token")
            routing = torch.softmax(logits, dim=-1)   # top-k in the logits' dtype, sums in >= fp32: as HF does
            chosen = torch.topk(routing.detach(), self.top_k, dim=-1).indices
            weights = routing.to(torch.promote_types(routing.dtype, torch.float32))
            mask = real.to(weights.dtype)
            counts = counts + torch.zeros_like(counts).scatter_add_(
                0, chosen.reshape(-1), mask.detach().to(torch.float64).repeat_interleave(self.top_k))
            rows = rows + mask.detach().to(torch.float64).sum()
            layer = (weights * mask[:, None]).sum(0)
            probs = layer if probs is None else probs + layer
        return RouterTerm(self, torch.cat([counts, rows.reshape(1)]), probs)


def real_rows(ctx: Any, tokens: int, device: torch.device) -> torch.Tensor:
    """Bool ``[tokens]``: this rank's shard rows that are data. A shard holds slice ``rank`` of its
    Ulysses group's stream (a ring group: of its ring shard), and the stream's first ``cu_seqlens[-1]``
    rows are data - a device comparison, no host read."""
    group = getattr(ctx, "group", None)
    import torch.distributed as dist
    local = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    start = local * tokens
    return (torch.arange(tokens, device=device) + start) < ctx.cu_seqlens[-1].to(device)


# --- reading the family's own code -------------------------------------------------------------------------------
def _source_tree(obj: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None


@lru_cache(maxsize=None)
def _call_site(cls: type) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """(num_experts, top_k, coefficient) expressions of ``cls.forward``'s
    ``aux = load_balancing_loss_func(outputs.router_logits, E, K, attention_mask)`` / ``loss += coef * aux``;
    None when the forward has no such call; ``UnsupportedModelError`` for another signature."""
    tree = _source_tree(cls.forward)
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == FUNCTION]
    if not calls:
        return None
    call = calls[0]
    args = list(call.args) + [k.value for k in call.keywords]
    ok = (len(calls) == 1 and len(call.args) == 4 and not call.keywords
          and ast.unparse(args[0]).endswith("router_logits") and ast.unparse(args[3]) == "attention_mask")
    coef = None
    for node in ast.walk(tree):   # loss += COEF * aux_loss(...)
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.value, ast.BinOp) \
                and isinstance(node.value.op, ast.Mult) and "aux_loss" in ast.unparse(node.value.right):
            coef = node.value.left
    if not ok or coef is None:
        raise UnsupportedModelError(f"{cls.__name__}.forward calls {FUNCTION}({', '.join(map(ast.unparse, args))}) "
                                    f"or adds it in a way FlexSP does not reproduce; set "
                                    f"config.output_router_logits=False")
    return args[1], args[2], coef


def _resolve(model: nn.Module, expr: ast.expr) -> Any:
    """The value of an attribute chain on ``self`` (``self.config.text_config.num_experts``)."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not (isinstance(expr, ast.Name) and expr.id == "self"):
        raise UnsupportedModelError(f"{model_name(model)}: the router loss argument {ast.unparse(expr)} is not an "
                                    f"attribute of the model")
    value: Any = model
    for attr in reversed(parts):
        value = getattr(value, attr)
    return value


def _function_dump(module_name: str) -> str | None:
    fn = getattr(sys.modules.get(module_name), FUNCTION, None)
    tree = _source_tree(fn) if fn is not None else None
    if tree is None:
        return None
    for node in ast.walk(tree):   # docstrings and comments are not the maths
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                           ast.Constant):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@lru_cache(maxsize=None)
def _same_maths(cls: type) -> bool:
    import importlib
    importlib.import_module(REFERENCE)
    ours = _function_dump(cls.__module__)
    return ours is not None and ours == _function_dump(REFERENCE)
