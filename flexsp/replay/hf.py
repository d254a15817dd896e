"""Hugging Face models for replay, from a config directory (random weights: timing needs no checkpoint).

Uses ``flexsp.hf`` (the adapter that puts a transformers causal LM behind the ``SPModel`` protocol and
routes its attention through ``ulysses_attention``), so the replay runs the same code training does.
``run_layers=k`` builds the model with ``k`` decoder layers and with none, and scales by the layer
count like ``ReplayModel.from_spec``.
"""
from __future__ import annotations

import copy
from typing import Any

from ..analytic import ModelSpec
from ..profile.compute import DeviceSetup
from .runner import ReplayError, ReplayModel


def _text(cfg: Any) -> Any:
    getter = getattr(cfg, "get_text_config", None)
    return getter() if callable(getter) else cfg


def _with_layers(cfg: Any, layers: int) -> Any:
    cfg = copy.deepcopy(cfg)
    text = _text(cfg)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):      # per-layer attention kinds (e.g. sliding)
        text.layer_types = text.layer_types[:layers]
    return cfg


def hf_replay_model(config: Any, setup: DeviceSetup, run_layers: int | None = None, seed: int = 0) -> ReplayModel:
    """A ``ReplayModel`` of the causal LM ``config`` describes (a directory with config.json, or a config)."""
    try:
        from ..hf import from_config, load_config
    except ImportError as exc:
        raise ReplayError(f"Hugging Face models need flexsp.hf and transformers (pip install -e '.[hf]'): {exc}") from None
    cfg = load_config(config)
    text = _text(cfg)
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    shape = ModelSpec(layers=layers, hidden=int(text.hidden_size), heads=heads,
                      kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                      ffn=int(getattr(text, "intermediate_size", 0) or 0), vocab=int(text.vocab_size),
                      name=str(getattr(cfg, "model_type", "hf")))
    k = layers if run_layers is None else min(int(run_layers), layers)
    if k < 1:
        raise ReplayError(f"run_layers must be >= 1, got {run_layers}")

    def build(n: int):
        return from_config(_with_layers(cfg, n), dtype=setup.dtype, device=setup.device, seed=seed)
    parts = ((build(k), 1.0),) if k == layers else ((build(k), layers / k), (build(0), 1.0 - layers / k))
    first = parts[0][0]
    q, kv = first.sp_heads()
    return ReplayModel(parts, int(q), int(kv), shape.vocab, shape, k)
