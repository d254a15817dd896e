"""Hugging Face models for replay, from a config directory (random weights: timing needs no checkpoint).

Uses ``flexsp.hf`` (the adapter that puts a transformers causal LM behind the ``SPModel`` protocol and
routes its attention through ``sp_attention``), so the replay runs the same code training does.
``run_layers=k`` builds the model with ``k`` decoder layers and with none, and scales by the layer
count like ``ReplayModel.from_spec``.
"""
from __future__ import annotations

from typing import Any

from flexsp.plan.specs import spec_from_hf_config
from flexsp.profile.compute import DeviceSetup
from flexsp.replay.runner import ReplayError, ReplayModel


def hf_replay_model(config: Any, setup: DeviceSetup, run_layers: int | None = None, seed: int = 0) -> ReplayModel:
    """A ``ReplayModel`` of the causal LM ``config`` describes (a directory with config.json, or a config)."""
    try:
        from flexsp.hf import from_config, load_config, with_layers
    except ImportError as exc:
        raise ReplayError(f"Hugging Face models need flexsp.hf and transformers (pip install -e '.[hf]'): {exc}") from None
    cfg = load_config(config)
    shape = spec_from_hf_config(cfg, name=str(getattr(cfg, "model_type", "hf")))
    layers = shape.layers
    k = layers if run_layers is None else min(int(run_layers), layers)
    if k < 1:
        raise ReplayError(f"run_layers must be >= 1, got {run_layers}")

    def build(n: int):
        return from_config(with_layers(cfg, n), dtype=setup.dtype, device=setup.device, seed=seed)
    parts = ((build(k), 1.0),) if k == layers else ((build(k), layers / k), (build(0), 1.0 - layers / k))
    first = parts[0][0]
    q, kv = first.sp_heads()
    return ReplayModel(parts, int(q), int(kv), shape.vocab, shape, k)
