"""Shared test data: tiny random-init models of each architecture and the unmodified-HF reference."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from flexsp.hf import tiny_config  # noqa: E402
from flexsp.runtime import loss_tokens, pack  # noqa: E402

# Llama; Qwen2 (qkv bias); Qwen3 (q/k norm, head_dim != hidden/heads); Mistral (sliding window
# 4096 > every sequence); Gemma (MQA: 1 kv head replicated up to degree 4, tied head, scaled
# embeddings); Phi3 (fused qkv and gate_up projections).
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")
LENGTHS = [9, 17, 5, 12, 3, 7, 11, 2, 6, 13]
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2)


def config(arch: str):
    return tiny_config(arch, **SMALL, **({"head_dim": 16} if arch in ("qwen3", "gemma") else {}))


def build(arch: str, state: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch)).double()
    if state is not None:
        model.load_state_dict(state)
    return model


def batch(seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SMALL["vocab_size"], (n,), generator=gen) for n in LENGTHS]


def reference(model, sequences) -> tuple:
    """The unmodified HF model on the whole batch packed into one row (its own packed-position
    masking): mean next-token loss over the batch and the flat gradient."""
    packed = pack(sequences, 1)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False).logits[0]
    loss = F.cross_entropy(logits, packed.labels, reduction="sum") / loss_tokens([len(s) for s in sequences])
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    return float(loss.detach()), grads.detach()
