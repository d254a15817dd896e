"""One line from a transformers model (or config) to a FlexSP-ready ``SPModel``."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapter import HFCausalLM
from .attention import install
from .features import UnsupportedModelError, check_supported, model_name

# Tiny random-init configs for tests, examples and profiling (no download).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
TINY_ARCH = {
    "llama": {},
    "qwen2": {},                                    # q/k/v projections with bias
    "qwen3": {"head_dim": 32},                      # q/k RMSNorm, head_dim independent of hidden/heads
    "mistral": {},                                  # sliding_window 4096 by default: exact below it
    "gemma": {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True},   # MQA, tied, scaled embed
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},   # fused qkv / gate_up projections
}


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small random-init config of ``arch`` (one of ``TINY_ARCH``); ``overrides`` win."""
    from transformers import AutoConfig
    if arch not in TINY_ARCH:
        raise UnsupportedModelError(f"no built-in tiny config for {arch!r}; choose one of {sorted(TINY_ARCH)}")
    return AutoConfig.for_model(arch, **{**TINY, **TINY_ARCH[arch], **overrides})


def load_config(source: str | os.PathLike | Any):
    """A config object as is, a directory holding ``config.json``, or a built-in tiny arch name."""
    from transformers import AutoConfig, PretrainedConfig
    if isinstance(source, PretrainedConfig):
        return source
    path = Path(source)
    if path.name == "config.json":
        path = path.parent
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    if str(source) in TINY_ARCH:
        return tiny_config(str(source))
    if path.is_dir():
        raise UnsupportedModelError(f"no config.json in {path}")
    raise UnsupportedModelError(f"model config {source!r} is neither a directory with config.json nor one of "
                                f"the built-in tiny archs {sorted(TINY_ARCH)}")


def prepare_model(model: nn.Module, *, max_seqlen: int | None = None, chunk_tokens: int | None = None,
                  shard: bool | dict = False) -> HFCausalLM:
    """Check ``model`` can train under FlexSP, install the attention wrapper on its key, wrap it.

    ``max_seqlen``: the longest sequence you will train (needed by sliding-window models: exact only
    within the window). ``shard``: True (or a dict of keyword arguments) applies FSDP2 through
    ``flexsp.runtime.prepare_model`` - ``fully_shard`` per decoder layer, then the root.
    """
    if not hasattr(model, "get_output_embeddings") or not hasattr(model, "config"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers causal LM (*ForCausalLM)")
    check_supported(model, max_seqlen)
    key = model.config._attn_implementation
    install(key)
    adapter = HFCausalLM(model, chunk_tokens=chunk_tokens)
    if shard:
        adapter = shard_states(adapter, **(shard if isinstance(shard, dict) else {}))
    return adapter


def shard_states(adapter: HFCausalLM, **kwargs: Any) -> nn.Module:
    """FSDP2 through the runtime's ``prepare_model`` (fully_shard per ``fsdp_units()``, then the root)."""
    try:
        from ..runtime import prepare_model as runtime_prepare
    except ImportError:
        raise UnsupportedModelError("this flexsp runtime has no sharded-state support (flexsp.runtime.prepare_model)"
                                    "; call prepare_model(..., shard=False)") from None
    return runtime_prepare(adapter, **kwargs)


def from_config(config: str | os.PathLike | Any, *, dtype: torch.dtype | None = None, device: Any = None,
                attn_implementation: str = "sdpa", seed: int | None = None, **prepare: Any) -> HFCausalLM:
    """Random-init a causal LM from a config (object, directory or tiny arch name) and prepare it."""
    from transformers import AutoModelForCausalLM
    cfg = load_config(config)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return prepare_model(model, **prepare)


__all__ = ["prepare_model", "from_config", "tiny_config", "load_config", "shard_states", "model_name", "TINY_ARCH"]
