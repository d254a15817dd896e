"""The docs' Trainer launch (docs/huggingface.md), run by ``test_trainer.py`` under a 2-rank torchrun:
``FlexSPTrainingArguments`` exactly as the docs write them (no ``use_cpu``). Writes what the Trainer
saw on this rank to ``OUT/rank<r>.json``: its world size and process index, the loader's world,
whether it logs and saves, and that its SP groups are closed when train() returns."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments

out = Path(sys.argv[1])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
tokenized = Dataset.from_dict({"input_ids": [[(7 * i + j) % 63 + 1 for j in range(n)]
                                             for i, n in enumerate([5, 12, 7, 3, 9, 4, 6, 10])]})
args = FlexSPTrainingArguments(output_dir=str(out / "run"), flexsp=True, flexsp_tokens_per_rank=16,
                               per_device_train_batch_size=2, max_steps=2, save_steps=2, report_to=[])
seen = {}


class Record(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        seen.update(world_size=args.world_size, process_index=args.process_index,
                    parallel_mode=str(args.parallel_mode), is_world_process_zero=state.is_world_process_zero,
                    should_save=args.should_save, dist_world=dist.get_world_size() if dist.is_initialized() else 1,
                    loader_world=trainer.flexsp_loader.cluster.num_gpus, use_cpu=args.use_cpu)
        pools.append(trainer._pool)


pools = []


trainer = FlexSPTrainer(model=model, args=args, train_dataset=tokenized, callbacks=[Record()])
trainer.train()
seen["pool_closed_after_train"] = bool(pools) and pools[-1].closed and trainer._pool is None
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
