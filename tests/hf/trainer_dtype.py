"""Run by tests/hf/test_trainer.py in its own process (the loader starts a process group): the FlexSP
step's compute dtype under ``FlexSPTrainingArguments(bf16=True)`` on an fp32 model, printed."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402

from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments  # noqa: E402
from hf.models import build  # noqa: E402

args = FlexSPTrainingArguments(output_dir=sys.argv[1], flexsp=True, flexsp_tokens_per_rank=64, report_to=[],
                               bf16=True, per_device_train_batch_size=2)
trainer = FlexSPTrainer(model=build("llama").float(), args=args,
                        train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4}))
trainer.get_train_dataloader()
print("compute dtype:", trainer._executor.autocast)
