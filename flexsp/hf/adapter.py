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

import re
import warnings
from typing import Sequence

import torch
from torch import nn

from flexsp.hf.attention import (CONTEXT_KWARG, POSITIONS_KWARG, RECEIPT_KWARG, RECOMPUTE_ATTR, install,
                                 temperature_tuned)
from flexsp.hf.features import (FEATURES_ATTR, UnsupportedModelError, attention_modules, decoder_of, layer_features,
                                logit_transform, model_name, text_config)
from flexsp.runtime.models.fused_loss import lm_head_loss
from flexsp.hf.mixers import install_mixers, ring_capable
from flexsp.hf.route import route_context
from flexsp.hf.router import RouterLoss, real_rows, router_flag
from flexsp.plan.memory import check_recompute
from flexsp.runtime.sp.context import AttentionContext, ShardingError, check_heads
from flexsp.runtime.sp.linear import check_linear_heads


# a composite config's other modality tokens by name: image/video/audio/frame/vision start, end, patch tokens
_MODALITY_TOKEN = re.compile(r"^(image|video|audio|frame|vision|low_res_image|boi|boa|eoi|eoa)[a-z_]*_(token_id|token_index|patch_id)$")
PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id",
                    "audio_token_index", "boi_token_id", "boi_token_index", "vision_start_token_id", "boa_token_id")


def freeze_non_language(model: nn.Module, name: str) -> tuple[str, ...]:
    """A composite (multimodal) model's parameters outside its language model and LM head: frozen
    (``requires_grad=False``), so training on text leaves them as loaded. Returns the frozen top-level
    module names and warns once naming them; () for a plain causal LM."""
    if text_config(model) is model.config:
        return ()
    keep = {id(p) for part in (decoder_of(model), model.get_output_embeddings()) for p in part.parameters()}
    frozen: dict[str, int] = {}
    for pname, param in model.named_parameters():
        if id(param) not in keep and param.requires_grad:
            param.requires_grad_(False)
            top = ".".join(pname.split(".")[:2])   # model.visual, model.multi_modal_projector, ...
            frozen[top] = frozen.get(top, 0) + param.numel()
    if frozen:
        warnings.warn(f"{name}: FlexSP trains its language model on text; {', '.join(sorted(frozen))} (vision/audio "
                      f"tower, projector) left untouched (requires_grad=False)", stacklevel=3)
    return tuple(sorted(frozen))


def placeholder_ids(model: nn.Module) -> torch.Tensor | None:
    """The composite model's image/video/audio placeholder token ids (None for a plain causal LM)."""
    cfg = model.config
    if text_config(model) is cfg:
        return None
    keys = set(PLACEHOLDER_KEYS) | {k for k in vars(cfg) if _MODALITY_TOKEN.match(k)}   # Molmo2: image_patch_id
    ids = sorted({int(v) for k in keys for v in [getattr(cfg, k, None)] if isinstance(v, int) and not isinstance(v, bool)})
    return torch.tensor(ids, dtype=torch.long) if ids else None


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
        # Llama 4's attention temperature tuning scales NoPE layers' queries by the row index in the call; its
        # layers get this shard's position ids so FlexSP's attention rescales them by position (exact when packed)
        self.temperature_tuned = any(temperature_tuned(m) for m in attention_modules(model).values())
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
        self.mixers = install_mixers(model)   # the token-mixer kinds it uses (flexsp.hf.mixers)
        self.linear_heads = int(getattr(text_config(model), "linear_num_value_heads", 0) or 0)
        self.frozen = freeze_non_language(model, self.name)   # a composite model's vision/audio towers: untouched
        self.placeholders = placeholder_ids(model)   # image/video/audio token ids FlexSP refuses in input_ids
        self.router = RouterLoss.of(model)   # None: no router auxiliary loss to add
        self.router_flag = router_flag(model)   # transformers reads it on every forward: a change must not pass

    @property
    def batch_coupled(self) -> bool:
        """A router loss to add (``flexsp.runtime.coupled``: the executor sums its statistics over the batch)."""
        return self.router is not None

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
        units = [m for m in self.decoder.modules() if type(m).__name__ in names]   # not a vision tower's blocks
        if not units:
            units = list(getattr(self.decoder, "layers", ()))
        if not units:
            raise UnsupportedModelError(f"{self.name}: cannot find its decoder layers (no _no_split_modules and no "
                                        f".layers)")
        return units

    def shard_loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                   ctx: AttentionContext) -> torch.Tensor:
        """Through ``__call__`` so that FSDP's hooks on the root module run."""
        if self.router is not None:
            raise UnsupportedModelError(f"{self.name} adds a router auxiliary loss over the whole batch: run it "
                                        f"through StepExecutor (shard_losses), which sums its statistics over the batch")
        return self(input_ids, position_ids, ctx, labels=labels)

    def shard_losses(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                     ctx: AttentionContext):
        """(summed LM loss, the router term) of this shard: ``flexsp.runtime.coupled``'s protocol."""
        return self(input_ids, position_ids, ctx, labels=labels, router=True)

    def batch_statistics(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         ctx: AttentionContext) -> torch.Tensor:
        """This shard's router statistics from a forward without the LM head (call under no_grad)."""
        out = self._decode(input_ids, position_ids, ctx)
        return self.router.term(out.router_logits, real_rows(ctx, input_ids.numel(), input_ids.device)).statistics

    # --- model ---------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return decoder_of(self.model)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      ctx: AttentionContext) -> torch.Tensor:
        """The decoder's last hidden states for this shard, ``[tokens, hidden]``."""
        return self._decode(input_ids, position_ids, ctx).last_hidden_state[0]

    def _decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext):
        """The decoder's output on this shard (with its router logits when the model adds a router loss)."""
        if input_ids.dim() == 1 and position_ids.dim() > 1 and position_ids.shape[-1] == input_ids.numel():
            raise UnsupportedModelError(f"{self.name}: {position_ids.dim()}-D position ids "
                                        f"{tuple(position_ids.shape)} (multimodal 3-D rotary positions, mRoPE): "
                                        f"FlexSP packs and shards 1-D per-sequence positions only")
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids and position_ids must be 1-D and alike, got {tuple(input_ids.shape)} and "
                             f"{tuple(position_ids.shape)}")
        if self.placeholders is not None:   # one host read per micro-batch, composite models only
            hit = torch.isin(input_ids, self.placeholders.to(input_ids.device))
            if bool(hit.any()):
                token = int(input_ids[hit][0])
                raise UnsupportedModelError(f"{self.name}: input_ids hold the image/video/audio placeholder token "
                                            f"{token}; FlexSP trains the language model on text only (no pixel or "
                                            f"audio inputs)")
        if router_flag(self.model) != self.router_flag:
            raise UnsupportedModelError(f"{self.name}: output_router_logits changed to {not self.router_flag} after "
                                        f"prepare_model, which read the router loss once; set it before prepare_model")
        heads, kv_heads = self.sp_heads()
        check_heads(heads, kv_heads, ctx.degree)
        if ctx.ring is not None and not ring_capable(self.mixers):   # before any collective of this forward
            raise UnsupportedModelError(f"{self.name} has recurrent token mixers ({', '.join(self.mixers[1:])}), which "
                                        f"cannot be split over a ring group exactly: plan it with Ulysses-only groups "
                                        f"(PlanConfig(ulysses_only=True))")
        if self.linear_heads and ctx.degree > 1:
            try:
                check_linear_heads(self.linear_heads, ctx.degree)
            except ShardingError as exc:
                raise UnsupportedModelError(f"{self.name}: {exc}") from None
        key = self.model.config._attn_implementation
        install(key)   # idempotent; covers a key switched after prepare_model (set_attn_implementation)
        no_mask = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=input_ids.device)
        receipt: list = []
        extra = {"output_router_logits": True} if self.router is not None else {}
        if self.temperature_tuned:
            extra[POSITIONS_KWARG] = position_ids
        out = self.decoder(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=no_mask,
                           use_cache=False, **extra, **{CONTEXT_KWARG: ctx, RECEIPT_KWARG: receipt})
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
        return out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttentionContext | None = None,
                labels: torch.Tensor | None = None, router: bool = False):
        """Logits; with ``labels`` the summed LM loss; with ``router`` too, ``(that loss, the router term)``."""
        if ctx is None:
            ctx = AttentionContext.single(input_ids.numel(), device=input_ids.device)   # bounds where the tokens are
        out = self._decode(input_ids, position_ids, ctx)
        hidden = out.last_hidden_state[0]
        head = self.model.get_output_embeddings()
        if labels is None:
            logits = head(hidden)
            if self.logit_scale != 1.0:
                logits = logits * self.logit_scale
            if self.logit_softcap is not None:
                logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
            return logits
        loss = lm_head_loss(hidden, head.weight, head.bias, labels, self.chunk_tokens, self.loss_kernel,
                            logit_scale=self.logit_scale, softcap=self.logit_softcap)
        if not router:
            return loss
        return loss, self.router.term(out.router_logits, real_rows(ctx, input_ids.numel(), input_ids.device))
