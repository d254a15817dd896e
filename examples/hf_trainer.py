"""Hugging Face ``Trainer`` with FlexSP switched on by one flag: a small Llama on 4 gloo ranks.

    torchrun --nproc_per_node=4 examples/hf_trainer.py --steps 6              # FlexSP, 4 CPU ranks (gloo)
    python examples/hf_trainer.py --no-flexsp --steps 6                       # the plain Trainer, one process
    torchrun --nproc_per_node=4 examples/hf_trainer.py --steps 6 --resume     # continue from the last checkpoint

The data is a long-tailed mix of random token sequences (a few long, many short), the global batch is
``--batch`` sequences per step either way: FlexSP plans each global batch into SP groups within
``--tokens-per-rank`` tokens per rank; the plain Trainer runs it padded in one process. Everything
else is the Trainer's: AdamW, linear schedule, logging, checkpoints under ``--out`` (runs/ is git-ignored).
``--history FILE`` writes the logged losses as JSON (the test compares both runs' curves).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

try:
    import flexsp  # noqa: F401
except ModuleNotFoundError:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--no-flexsp", dest="flexsp", action="store_false", help="the plain Trainer (padded batches)")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=8, help="sequences per global batch")
parser.add_argument("--sequences", type=int, default=48)
parser.add_argument("--tokens-per-rank", type=int, default=96)
parser.add_argument("--save-steps", type=int, default=3)
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
parser.add_argument("--out", type=Path, default=Path("runs/hf_trainer"))
parser.add_argument("--history", type=Path, default=None, help="write the logged losses here (JSON)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--run-dir", type=Path, default=None,
                    help="record every FlexSP step against its plan there (flexsp.telemetry; `flexsp report DIR`)")
args = parser.parse_args()

torch.set_num_threads(1)
# Long-tailed lengths: most sequences short, a few near the largest group's capacity.
rng = np.random.default_rng(args.seed)
lengths = np.clip(rng.lognormal(3.0, 0.9, args.sequences).astype(int), 2, args.tokens_per_rank * 3)
rows = [rng.integers(1, 256, int(n)).tolist() for n in lengths]
dataset = Dataset.from_dict({"input_ids": rows})

torch.manual_seed(args.seed)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024)
model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))


def pad(features):
    """The plain Trainer's collator: right-padded rows, -100 labels on padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = labels[i, :n] = torch.tensor(f["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SameBatches(FlexSPTrainer):
    """The plain run draws the same global batches as FlexSP's loader (its shuffle of the epoch)."""

    def _get_train_sampler(self, train_dataset=None):
        if self.flexsp:
            return super()._get_train_sampler(train_dataset)
        return list(np.random.default_rng([self.args.seed, 0]).permutation(len(self.train_dataset)))


import os  # noqa: E402

world = int(os.environ.get("WORLD_SIZE", "1"))
if args.batch % world:
    raise SystemExit(f"--batch {args.batch} is not a multiple of the world size {world}")
training = FlexSPTrainingArguments(
    output_dir=str(args.out), flexsp=args.flexsp, flexsp_tokens_per_rank=args.tokens_per_rank,
    flexsp_run_dir=None if args.run_dir is None else str(args.run_dir),
    per_device_train_batch_size=args.batch // world, max_steps=args.steps, learning_rate=1e-3, lr_scheduler_type="linear",
    warmup_steps=1, logging_steps=1, save_steps=args.save_steps, save_strategy="steps", report_to=[], seed=args.seed,
    # use_cpu: CPU ranks (gloo) for both runs. FlexSP sets it itself where there is no CUDA; the plain
    # Trainer needs it to run DDP over torchrun's ranks on CPUs instead of a world of one per rank.
    use_cpu=True, dataloader_drop_last=False, remove_unused_columns=False, disable_tqdm=True)
trainer = SameBatches(model=model, args=training, train_dataset=dataset,
                      data_collator=None if args.flexsp else pad)   # FlexSP packs its batches itself
output = trainer.train(resume_from_checkpoint=True if args.resume else None)
losses = {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}
order = np.random.default_rng([args.seed, 0]).permutation(len(dataset))   # both runs' epoch-0 order
tokens = int(sum(lengths[order[:args.steps * args.batch]]))
if trainer.args.process_index == 0:
    print(f"{'flexsp' if args.flexsp else 'plain'} losses: " + " ".join(f"{s}:{v:.6f}" for s, v in sorted(losses.items())))
    print(f"tokens {tokens} in {output.metrics['train_runtime']:.2f} s: {tokens / output.metrics['train_runtime']:.0f} tok/s")
    if args.history:
        args.history.write_text(json.dumps({"losses": losses, "tokens": tokens,
                                            "seconds": output.metrics["train_runtime"]}))
import torch.distributed as dist  # noqa: E402

if dist.is_initialized():   # a clean teardown (gloo aborts a process that exits with its group alive)
    dist.barrier()
    dist.destroy_process_group()
