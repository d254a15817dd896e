"""``HFCausalLM``: a transformers causal LM behind FlexSP's ``SPModel`` protocol.

The executor hands each rank a flat packed token shard (batch dimension 1, position ids restarted
per sequence) and an ``AttentionContext``. The adapter runs the model's decoder on it with the
context in the forward kwargs (transformers passes them down to every attention call, where the
registry wrapper of ``attention.py`` picks them up) and an empty prepared 4-D mask, which
transformers' mask builders return as is: no ``[tokens, tokens]`` mask is built for a shard whose
real layout is ``ctx.cu_seqlens``. The loss goes through the LM head fused with its backward (``flexsp.runtime.models.fused_loss``: a
field library's kernel on CUDA where it serves the call, FlexSP's own chunked loss otherwise).

Why not a mask function in transformers' ``AttentionMaskInterface``: a mask function is chosen by
the model's key and gets no forward kwargs, so one registered under the key FlexSP keeps (``sdpa``,
...) would drop the mask of the same model's native calls too (the probe's reference, generation);
a key of FlexSP's own would change the model's ``_attn_implementation``. The prepared 4-D mask is
per call, covers every builder (causal, sliding, chunked) and costs nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from flexsp.hf.attention import CONTEXT_KWARG, RECEIPT_KWARG, RECOMPUTE_ATTR, install
from flexsp.hf.features import (FEATURES_ATTR, UnsupportedModelError, attention_modules, decoder_of, layer_features,
                                logit_transform, model_name, text_config)
from flexsp.runtime.models.fused_loss import lm_head_loss
from flexsp.hf.route import route_context
from flexsp.plan.memory import check_recompute
from flexsp.runtime.sp.context import AttentionContext, check_heads


class HFCausalLM(nn.Module):
    """Wraps ``model`` (a ``*ForCausalLM``); its parameters are the model's, unchanged.

    ``forward(input_ids, position_ids, ctx)`` -> this shard's logits ``[tokens, vocab]``;
    ``forward(..., labels=labels)`` / ``shard_loss`` -> the summed next-token loss of the shard.
    Build it with ``flexsp.hf.prepare_model``, which also installs the attention function.
    ``chunk_tokens`` / ``loss_kernel``: ``lm_head_loss``'s (None: a memory budget / "auto").
    """

    def __init__(self, model: nn.Module, *, chunk_tokens: int | None = None, loss_kernel: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens, self.loss_kernel = chunk_tokens, loss_kernel
        self.name = model_name(model)
        # per-layer attention features and the head's logit transform: read once here, passed down explicitly
        features = layer_features(model)
        for index, module in attention_modules(model).items():
            if index in features:
                setattr(module, FEATURES_ATTR, features[index])
        self.features = features
        self.logit_scale, self.logit_softcap = logit_transform(model)
        # Llama 4's attention temperature tuning scales NoPE layers' queries by the row's index in the call,
        # not its position id: the same as native only while every row index stays below floor_scale - 1
        floors = [int(m.floor_scale) for m in attention_modules(model).values()
                  if getattr(m, "attn_temperature_tuning", False) and getattr(m, "use_rope", True) is False]
        self.temperature_floor = min(floors) if floors else None
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise UnsupportedModelError(f"{self.name}: the output embedding is {type(head).__name__}, not a Linear "
                                        f"LM head")
        # layers that drop **kwargs (StableLM) get the context through hooks; [] when none needs them
        try:
            layers = list(self.fsdp_units())
        except UnsupportedModelError:   # no decoder layers (a 0-layer base for profiling): nothing to route
            layers = []
        self.routed = route_context(layers, self.name)

    def set_recompute(self, recompute: str) -> None:
        """Activation checkpointing (``flexsp.plan.memory.RECOMPUTE``): "full" is transformers' own
        per-layer gradient checkpointing (each decoder layer keeps only its input); "selective" recomputes
        only the attention core (kernel and SP exchanges) in backward; "none" keeps everything."""
        mode = check_recompute(recompute)
        if mode == "full":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif getattr(self.model, "is_gradient_checkpointing", False):
            self.model.gradient_checkpointing_disable()
        for layer in self.fsdp_units():
            for module in layer.modules():
                setattr(module, RECOMPUTE_ATTR, mode == "selective")
        self.recompute = mode

    # --- SPModel -------------------------------------------------------------------------------
    def sp_heads(self) -> tuple[int, int]:
        cfg = text_config(self.model)
        heads = int(cfg.num_attention_heads)
        return heads, int(getattr(cfg, "num_key_value_heads", None) or heads)

    def fsdp_units(self) -> Sequence[nn.Module]:
        """The decoder layers: the modules transformers itself never splits (``_no_split_modules``)."""
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        units = [m for m in self.model.modules() if type(m).__name__ in names]
        if not units:
            units = list(getattr(self.decoder, "layers", ()))
        if not units:
            raise UnsupportedModelError(f"{self.name}: cannot find its decoder layers (no _no_split_modules and no "
                                        f".layers)")
        return units

    def shard_loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                   ctx: AttentionContext) -> torch.Tensor:
        """Through ``__call__`` so that FSDP's hooks on the root module run."""
        return self(input_ids, position_ids, ctx, labels=labels)

    # --- model ---------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return decoder_of(self.model)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      ctx: AttentionContext) -> torch.Tensor:
        """The decoder's last hidden states for this shard, ``[tokens, hidden]``."""
        if input_ids.dim() == 1 and position_ids.dim() > 1 and position_ids.shape[-1] == input_ids.numel():
            raise UnsupportedModelError(f"{self.name}: {position_ids.dim()}-D position ids "
                                        f"{tuple(position_ids.shape)} (multimodal 3-D rotary positions, mRoPE): "
                                        f"FlexSP packs and shards 1-D per-sequence positions only")
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids and position_ids must be 1-D and alike, got {tuple(input_ids.shape)} and "
                             f"{tuple(position_ids.shape)}")
        if self.temperature_floor is not None and max(input_ids.numel(), ctx.max_seqlen) >= self.temperature_floor:
            raise UnsupportedModelError(
                f"{self.name}: attention temperature tuning (NoPE layers) scales queries by their index in the "
                f"packed row, not their position in the sequence; FlexSP is exact only while shards and sequences "
                f"stay below floor_scale={self.temperature_floor} tokens (got a shard of {input_ids.numel()} and a "
                f"sequence of {ctx.max_seqlen})")
        heads, kv_heads = self.sp_heads()
        check_heads(heads, kv_heads, ctx.degree)
        key = self.model.config._attn_implementation
        install(key)   # idempotent; covers a key switched after prepare_model (set_attn_implementation)
        no_mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=input_ids.device)
        receipt: list = []
        out = self.decoder(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=no_mask,
                           use_cache=False, **{CONTEXT_KWARG: ctx, RECEIPT_KWARG: receipt})
        layers = int(text_config(self.model).num_hidden_layers)
        if len(receipt) > layers:   # e.g. differential attention: two calls per layer, not what the probe vouches for
            raise UnsupportedModelError(
                f"{self.name}: its {layers} decoder layers made {len(receipt)} attention calls (key {key!r}), more "
                f"than one per layer: a custom attention scheme FlexSP does not claim to reproduce")
        if len(receipt) != layers:   # never let SP silently do nothing (or only half of it)
            raise UnsupportedModelError(
                f"{self.name}: {len(receipt)} of its {layers} decoder layers ran FlexSP's attention (key {key!r}); the "
                f"others mix tokens some other way (linear attention, state-space layers, a custom attention call) "
                f"and would see only this rank's shard")
        return out.last_hidden_state[0]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if ctx is None:
            ctx = AttentionContext.single(input_ids.numel())
        hidden = self.hidden_states(input_ids, position_ids, ctx)
        head = self.model.get_output_embeddings()
        if labels is None:
            logits = head(hidden)
            if self.logit_scale != 1.0:
                logits = logits * self.logit_scale
            if self.logit_softcap is not None:
                logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
            return logits
        return lm_head_loss(hidden, head.weight, head.bias, labels, self.chunk_tokens, self.loss_kernel,
                            logit_scale=self.logit_scale, softcap=self.logit_softcap)
