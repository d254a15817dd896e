"""One line from a transformers model (or config) to a FlexSP-ready ``SPModel``."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flexsp.hf.adapter import HFCausalLM
from flexsp.hf.mixers import install_mixers
from flexsp.hf.features import UnsupportedModelError, check_supported, model_name
from flexsp.hf.probe import probe as run_probe
from flexsp.inputs import read_json
from flexsp.plan.specs import ModelSpec, get_model, model_names
from flexsp.runtime.fsdp import shard_model

MAX_POSITIONS = 4096   # tiny configs: rotary tables long enough for every test sequence


def tiny_archs() -> tuple[str, ...]:
    """Families with a built-in tiny config: the registry's ``hf-*`` entries (``flexsp.plan.specs``)."""
    return tuple(get_model(n).family for n in model_names(prefix="hf-"))


def hf_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """The transformers config keys of a registry entry (the inverse of ``spec_from_hf_config``)."""
    out = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
               num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
               max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=spec.tie_embeddings)
    if spec.head_dim is not None:
        out["head_dim"] = spec.head_dim
    return {**out, **dict(spec.hf_extra)}


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small random-init config of ``arch`` (one of ``tiny_archs()``); ``overrides`` win."""
    from transformers import AutoConfig
    if arch not in tiny_archs():
        raise UnsupportedModelError(f"no built-in tiny config for {arch!r}; choose one of {sorted(tiny_archs())}")
    return AutoConfig.for_model(arch, **{**hf_config_kwargs(get_model(f"hf-{arch}")), **overrides})


# per-layer lists of a text config (one entry per layer: cut) and lists of layer indices (kept below the cut)
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "no_rope_layers")
LAYER_INDEX_LISTS = ("moe_layers", "mlp_only_layers")


def with_layers(config: Any, layers: int) -> Any:
    """A copy of ``config`` with ``layers`` decoder layers, its per-layer lists cut to match: attention kinds
    (``layer_types``), MLP kinds (``mlp_layer_types``, which transformers checks against the layer count),
    Llama 4's ``no_rope_layers``, and the layer indices of ``moe_layers`` / ``mlp_only_layers``."""
    config = copy.deepcopy(config)
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    text.num_hidden_layers = layers
    for name in PER_LAYER_LISTS:
        if getattr(text, name, None) is not None:
            setattr(text, name, list(getattr(text, name))[:layers])
    for name in LAYER_INDEX_LISTS:
        if isinstance(getattr(text, name, None), (list, tuple)):
            setattr(text, name, [i for i in getattr(text, name) if int(i) < layers])
    return config


def load_config(source: str | os.PathLike | Any):
    """A config object as is, a directory holding ``config.json``, or a built-in tiny arch name.

    A directory is untrusted (``--hf-config DIR``): its ``config.json`` is read through the bounded JSON reader,
    one that names custom model code (``auto_map``) is refused (FlexSP never runs code from a model directory;
    transformers would ask on stdin and run it on a "y"), and whatever transformers rejects is one line."""
    from transformers import AutoConfig, PretrainedConfig
    if isinstance(source, PretrainedConfig):
        return source
    path = Path(source)
    if path.name == "config.json":
        path = path.parent
    if (path / "config.json").is_file():
        raw = read_json(path / "config.json", "model config", UnsupportedModelError)
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"model config {path / 'config.json'} must be a JSON object, "
                                        f"got {type(raw).__name__}")
        if "auto_map" in raw:
            raise UnsupportedModelError(f"model config {path / 'config.json'} names custom model code (auto_map); "
                                        f"FlexSP never runs code from a model directory: use a model type "
                                        f"transformers ships")
        try:
            return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as exc:   # transformers raises OSError, ValueError, KeyError, its own validation errors
            raise UnsupportedModelError(f"cannot read model config {path / 'config.json'}: {_reason(exc)}") from None
    if str(source) in tiny_archs():
        return tiny_config(str(source))
    if path.is_dir():
        raise UnsupportedModelError(f"no config.json in {path}")
    raise UnsupportedModelError(f"model config {source!r} is neither a directory with config.json nor one of "
                                f"the built-in tiny archs {sorted(tiny_archs())}")


def prepare_model(model: nn.Module, *, max_seqlen: int | None = None, chunk_tokens: int | None = None,
                  loss_kernel: str | None = None, shard: bool | dict = False, probe: bool = True) -> HFCausalLM:
    """Check ``model`` can train under FlexSP, install the attention wrapper on its key, wrap it.

    ``max_seqlen``: the longest sequence you will train (needed by sliding-window models: exact only
    within the window). ``chunk_tokens`` / ``loss_kernel``: the LM-head loss's
    (``flexsp.runtime.models.fused_loss``; None: a memory budget / "auto"). ``probe``: run ``flexsp.hf.probe`` (one packed forward at SP degree 1 against the
    native model, no collective) so that a model FlexSP would get wrong is refused here. ``shard``: True (or a dict of keyword arguments) applies FSDP2 through
    ``flexsp.runtime.shard_model`` - ``fully_shard`` per decoder layer, then the root.
    """
    if not hasattr(model, "get_output_embeddings") or not hasattr(model, "config"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers causal LM (*ForCausalLM)")
    check_supported(model, max_seqlen)
    install_mixers(model)   # softmax attention under the model's key, and every other registered token mixer
    adapter = HFCausalLM(model, chunk_tokens=chunk_tokens, loss_kernel=loss_kernel)
    if probe:
        run_probe(adapter)
    if shard:
        adapter = shard_states(adapter, **(shard if isinstance(shard, dict) else {}))
    return adapter


def shard_states(adapter: HFCausalLM, **kwargs: Any) -> nn.Module:
    """FSDP2 through the runtime's ``shard_model`` (fully_shard per ``fsdp_units()``, then the root)."""
    return shard_model(adapter, **kwargs)


def from_config(config: str | os.PathLike | Any, *, dtype: torch.dtype | None = None, device: Any = None,
                attn_implementation: str = "sdpa", seed: int | None = None, **prepare: Any) -> HFCausalLM:
    """Random-init a causal LM from a config (object, directory or tiny arch name) and prepare it."""
    from transformers import AutoModelForCausalLM
    cfg = load_config(config)
    check_fits(cfg, config, dtype, device, attn_implementation)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:   # e.g. a negative size in the config
        raise UnsupportedModelError(f"cannot build a model from {config}: {_reason(exc)}") from exc
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return prepare_model(model, **prepare)


def _reason(exc: Exception) -> str:
    """What transformers or torch said on one line (their messages run to paragraphs), at most 300 characters: the
    first line, and the next ones while it ends in a colon (pydantic's "Validation error for field 'x':" puts
    the reason on the line after)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    kept = [lines[0]]
    for line in lines[1:]:
        if not kept[-1].endswith(":"):
            break
        kept.append(line)
    return " ".join(kept)[:300]


def check_fits(cfg: Any, source: Any, dtype: torch.dtype | None, device: Any, attn_implementation: str = "sdpa") -> None:
    """Refuse a config whose model outgrows this machine's memory before a byte is allocated: the model is
    built on the meta device (exact parameter count, ~15 ms) and its bytes, as built on the CPU and as moved
    to ``device``, compared with their total memory. A config is untrusted input, and its sizes are only
    numbers: a 10**6 hidden size asks for terabytes."""
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                cfg, attn_implementation=attn_implementation).parameters())
    except Exception:          # a family that cannot build on meta: the real build names its own problem
        return
    built = count * torch.get_default_dtype().itemsize
    budgets = [("this machine's", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), built)]
    target = torch.device(device) if device is not None else None
    if target is not None and target.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(target).total_memory
        budgets.append((f"{target}'s", total, count * (dtype or torch.get_default_dtype()).itemsize))
    for where, total, need in budgets:
        if need > total:
            raise UnsupportedModelError(f"the model of {source} has {count:,} parameters ({need / 2**30:,.1f} GiB), "
                                        f"more than {where} {total / 2**30:,.1f} GiB of memory; use a smaller config "
                                        f"(replay and profile build only a few layers of it)")


__all__ = ["prepare_model", "from_config", "check_fits", "tiny_config", "load_config", "shard_states", "model_name", "tiny_archs", "with_layers",
           "hf_config_kwargs"]
