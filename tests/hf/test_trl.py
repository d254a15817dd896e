"""examples/sft_trl.py: TRL's SFTTrainer with FlexSP on 4 gloo ranks (torchrun) against TRL's own SFTTrainer in
one process on the same global batches, for prompt-completion data (completion-only loss) and conversational
data (assistant-only loss through the chat template's generation markers), and a resumed FlexSP run against the
uninterrupted one (bitwise). fp64 model; the logged losses pass through the Trainer's fp32 accumulator (1e-6
relative), weights agree to 1e-6 of each tensor's largest entry."""
import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("trl")
from safetensors.torch import load_file  # noqa: E402
from scripts import experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft_trl.py"
STEPS = ["--steps", "4", "--save-steps", "2", "--sequences", "32"]
SGD = ["--optim", "sgd", "--lr", "0.5"]


def _run(tmp_path, name, *argv, ranks=1):
    launcher, env = experiment("launch").torchrun(ranks)
    history = tmp_path / f"{name}.json"
    proc = subprocess.run([*launcher, str(EXAMPLE), *STEPS, "--out", str(tmp_path / name), "--history", str(history),
                           *argv], capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {int(k): v for k, v in json.loads(history.read_text())["losses"].items()}


def _params(tmp_path, name, step):
    return load_file(str(tmp_path / name / f"checkpoint-{step}" / "model.safetensors"))


def _assert_same_training(tmp_path, flex, plain, a_name, b_name):
    assert sorted(flex) == sorted(plain) == [1, 2, 3, 4]
    for step in plain:
        assert flex[step] == pytest.approx(plain[step], rel=1e-6)
    assert plain[1] != pytest.approx(plain[4], rel=1e-6)   # the curve moves: the comparison is not vacuous
    a, b = _params(tmp_path, a_name, 4), _params(tmp_path, b_name, 4)
    for key in b:
        assert float((a[key] - b[key]).abs().max()) <= 1e-6 * float(b[key].abs().max()), key


@pytest.mark.parametrize("data", ["prompt-completion", "conversational"])
def test_flexsp_equals_trls_own_trainer(tmp_path, data):
    """SGD: the comparison measures the gradients. (TRL computes log-probabilities in fp32 even for an fp64
    model; under AdamW that rounding in near-zero gradients moved weights by 3.7e-6 of their scale.)"""
    plain = _run(tmp_path, "trl", "--no-flexsp", "--data", data, *SGD)
    flex = _run(tmp_path, "flex", "--data", data, *SGD, ranks=4)
    _assert_same_training(tmp_path, flex, plain, "flex", "trl")


def test_resumed_sft_continues_bit_for_bit(tmp_path):
    flex = _run(tmp_path, "flex", "--data", "conversational", ranks=4)       # AdamW: optimizer state resumes too
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "flex" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tmp_path, "resumed", "--data", "conversational", "--resume", ranks=4)
    assert resumed[3] == flex[3] and resumed[4] == flex[4]
    a, b = _params(tmp_path, "resumed", 4), _params(tmp_path, "flex", 4)
    assert all(torch.equal(a[key], b[key]) for key in b)


def test_config_shares_the_flexsp_fields_with_the_trainer_arguments():
    from trl import SFTConfig

    from flexsp.hf.trainer import FlexSPArguments, FlexSPTrainingArguments
    from flexsp.hf.trl import FlexSPSFTConfig
    assert issubclass(FlexSPSFTConfig, SFTConfig) and issubclass(FlexSPSFTConfig, FlexSPArguments)
    assert issubclass(FlexSPTrainingArguments, FlexSPArguments)
    mine = {f.name for f in dataclasses.fields(FlexSPArguments)}
    assert {"flexsp", "flexsp_tokens_per_rank", "flexsp_cost"} <= mine
    for cls in (FlexSPSFTConfig, FlexSPTrainingArguments):
        assert mine <= {f.name for f in dataclasses.fields(cls)}
        assert all(name not in vars(cls).get("__annotations__", {}) for name in mine)   # inherited, not restated


@pytest.mark.parametrize("setting", ["packing", "padding_free"])
def test_trl_packing_is_refused_with_flexsp(tmp_path, setting):
    from datasets import Dataset

    from flexsp.hf.trainer import TrainerSetupError
    from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer
    from .models import build
    args = FlexSPSFTConfig(output_dir=str(tmp_path), flexsp=True, flexsp_tokens_per_rank=64, use_cpu=True,
                           report_to=[], bf16=False, **{setting: True})
    with pytest.raises(TrainerSetupError, match=f"{setting}=True with flexsp=True: FlexSP already packs") as info:
        FlexSPSFTTrainer(model=build("llama"), args=args,
                         train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    assert "\n" not in str(info.value)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = [f"w{i}" for i in range(20)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *words])},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.parametrize("completion_only", [True, False])
def test_the_loader_sees_the_labels_trl_built_and_no_mask_it_left_unapplied(tmp_path, completion_only):
    """completion_only_loss=False: TRL trains every token and leaves completion_mask in the rows; FlexSP must not
    apply it (nor refuse it as disagreeing with the labels)."""
    from datasets import Dataset

    from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer
    from .models import build
    rows = [{"prompt": "w1 w2 w3", "completion": " w4 w5"}, {"prompt": "w6", "completion": " w7 w8 w9"}]
    args = FlexSPSFTConfig(output_dir=str(tmp_path), flexsp=True, flexsp_tokens_per_rank=64, use_cpu=True,
                           report_to=[], bf16=False, completion_only_loss=completion_only)
    trainer = FlexSPSFTTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=_tokenizer())
    prepared = trainer.train_dataset
    assert "labels" in prepared.column_names and "completion_mask" not in prepared.column_names
    first = prepared[0]
    assert first["input_ids"] == [3 + 1, 3 + 2, 3 + 3, 3 + 4, 3 + 5, 1]   # w1 w2 w3 w4 w5 <eos>
    assert first["labels"] == ([-100] * 3 + first["input_ids"][3:] if completion_only else first["input_ids"])
