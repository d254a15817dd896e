"""Train Hugging Face ``transformers`` causal LMs under FlexSP's planned, per-step SP groups.

    from flexsp.hf import prepare_model
    sp_model = prepare_model(AutoModelForCausalLM.from_config(cfg))   # an SPModel for the executor

| module | job |
|---|---|
| ``attention`` | the registry wrapper under the model's own attention key: Ulysses when the call carries a context |
| ``adapter`` | ``HFCausalLM``: packed shard in, logits or summed loss out; ``sp_heads``/``fsdp_units`` |
| ``features`` | refuse what the attention cannot honour (sliding window, chunk, softcap, sinks, dropout, non-causal, cross-attention) |
| ``mixers`` | the token-mixer registry: softmax attention, Gated DeltaNet linear attention (``linear_attention``) |
| ``router`` | a MoE router's load-balancing loss over the global batch |
| ``prepare`` | ``prepare_model`` / ``from_config`` / tiny built-in configs |
| ``route`` | the context to attention modules of layers that drop ``**kwargs`` (StableLM) |
| ``probe`` | a packed degree-1 forward against the native model: refuse what FlexSP would get wrong |
| ``families`` | every causal LM of transformers' registry: exact under a plan or refused (the matrix) |
| ``trainer`` | ``FlexSPTrainer``: HF Trainer with one flag (import it directly; needs accelerate) |

Needs the ``hf`` extra (``pip install flexsp[hf]``).
"""
from flexsp.hf.adapter import HFCausalLM
from flexsp.hf.attention import CONTEXT_KWARG, install, is_installed, uninstall
from flexsp.hf.features import UnsupportedModelError, check_supported
from flexsp.runtime.models.loss import linear_cross_entropy
from flexsp.hf.prepare import (from_config, hf_config_kwargs, load_config, prepare_model, shard_states, tiny_archs,
                               tiny_config, with_layers)

__all__ = ["HFCausalLM", "prepare_model", "from_config", "tiny_config", "load_config", "shard_states", "tiny_archs", "with_layers", "hf_config_kwargs",
           "UnsupportedModelError", "check_supported", "linear_cross_entropy", "install", "uninstall",
           "is_installed", "CONTEXT_KWARG"]
