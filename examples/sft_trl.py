"""Supervised fine-tuning with TRL's ``SFTTrainer`` under FlexSP: loss on completions / assistant turns only.

    torchrun --nproc_per_node=4 examples/sft_trl.py --data prompt-completion --steps 4    # FlexSP, 4 CPU ranks (gloo)
    python examples/sft_trl.py --no-flexsp --data conversational --steps 4                # TRL's own SFTTrainer
    torchrun --nproc_per_node=4 examples/sft_trl.py --steps 4 --resume                    # continue from a checkpoint

Everything is local (no hub): a word-level tokenizer with a chat template whose ``{% generation %}`` markers
give TRL its assistant masks, and a tiny Llama. ``--data prompt-completion``: ``{"prompt", "completion"}`` rows
(TRL's ``completion_only_loss``: the prompt carries no loss); ``--data conversational``: multi-turn ``messages``
with ``assistant_only_loss=True`` (only the assistant's turns carry loss). TRL tokenises, applies the template,
builds the labels and truncates to ``--max-length``; FlexSP plans each global batch (``--batch`` sequences)
into SP groups within ``--tokens-per-rank`` tokens per rank. ``--no-flexsp`` runs TRL's own trainer on the
same global batches, padded, in one process. ``--history FILE`` writes the logged losses (the test compares
the two runs with ``--optim sgd --optim-args momentum=0.9``: TRL computes its log-probabilities in fp32 even
for an fp64 model, and Adam turns that rounding in near-zero gradients into updates that differ by ~4e-6 of a
weight's scale; momentum keeps an optimizer state for the resume to restore).
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

try:
    import flexsp  # noqa: F401
except ModuleNotFoundError:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datasets  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--no-flexsp", dest="flexsp", action="store_false", help="TRL's own SFTTrainer (padded batches)")
parser.add_argument("--data", default="prompt-completion", choices=["prompt-completion", "conversational"])
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=8, help="sequences per global batch")
parser.add_argument("--sequences", type=int, default=32)
parser.add_argument("--tokens-per-rank", type=int, default=64)
parser.add_argument("--max-length", type=int, default=160, help="TRL truncates longer rows")
parser.add_argument("--save-steps", type=int, default=2)
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
parser.add_argument("--out", type=Path, default=Path("runs/sft_trl"))
parser.add_argument("--history", type=Path, default=None, help="write the logged losses here (JSON)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--optim", default="adamw_torch", help="the Trainer's optimizer (the test compares with sgd)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--optim-args", default=None, help='the optimizer\'s extra settings, e.g. "momentum=0.9" for sgd')
args = parser.parse_args()
torch.set_num_threads(1)
datasets.disable_progress_bars()

# A local tokenizer: one token per word, the chat template's role markers and EOS as special tokens.
WORDS = [f"w{i}" for i in range(48)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                    additional_special_tokens=SPECIAL[3:])
tokenizer.chat_template = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|> "
    "{% endgeneration %}{% else %}<|user|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}")

# Long-tailed data: most rows short, a few long.
rng = np.random.default_rng(args.seed)
text = lambda n: " ".join(rng.choice(WORDS, size=max(1, int(n))))   # noqa: E731
size = lambda: int(np.clip(rng.lognormal(2.3, 0.8), 1, 60))          # noqa: E731
if args.data == "prompt-completion":
    dataset = Dataset.from_list([{"prompt": text(size()), "completion": " " + text(size())}
                                 for _ in range(args.sequences)])
else:
    dataset = Dataset.from_list([{"messages": [{"role": role, "content": text(size())}
                                               for _ in range(int(rng.integers(1, 3))) for role in ("user", "assistant")]}
                                 for _ in range(args.sequences)])

torch.manual_seed(args.seed)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512)).to(getattr(torch, args.dtype))


class SameBatches(FlexSPSFTTrainer):
    """TRL's run draws the same global batches as FlexSP's loader (its shuffle of the epoch)."""

    def _get_train_sampler(self, train_dataset=None):
        if self.flexsp:
            return super()._get_train_sampler(train_dataset)
        return list(np.random.default_rng([self.args.seed, 0]).permutation(len(self.train_dataset)))


world = int(os.environ.get("WORLD_SIZE", "1"))
config = FlexSPSFTConfig(
    output_dir=str(args.out), flexsp=args.flexsp, flexsp_tokens_per_rank=args.tokens_per_rank,
    max_length=args.max_length, assistant_only_loss=args.data == "conversational",
    per_device_train_batch_size=args.batch // world, max_steps=args.steps, learning_rate=args.lr, optim=args.optim,
    optim_args=args.optim_args, logging_steps=1, save_steps=args.save_steps, report_to=[], seed=args.seed, use_cpu=True,
    bf16=False, gradient_checkpointing=False, disable_tqdm=True)   # TRL's defaults are bf16 and checkpointing
trainer = SameBatches(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
trainer.train(resume_from_checkpoint=True if args.resume else None)
losses = {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
if trainer.args.process_index == 0:
    print(f"{'flexsp' if args.flexsp else 'trl'} {args.data} losses: "
          + " ".join(f"{s}:{v:.6f}" for s, v in sorted(losses.items())))
    if args.history:
        args.history.write_text(json.dumps({"losses": losses}))
import torch.distributed as dist  # noqa: E402

if dist.is_initialized():   # a clean teardown (gloo aborts a process that exits with its group alive)
    dist.barrier()
    dist.destroy_process_group()
