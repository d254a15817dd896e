"""examples/sft_trl.py: TRL's SFTTrainer with FlexSP on 4 gloo ranks (torchrun) against TRL's own SFTTrainer in
one process on the same global batches, for prompt-completion data (completion-only loss) and conversational
data (assistant-only loss through the chat template's generation markers), and a resumed FlexSP run against the
uninterrupted one (bitwise). fp64 model; the logged losses pass through the Trainer's fp32 accumulator (1e-6
relative), weights agree to 1e-6 of each tensor's largest entry. Each run is made once per module (``sft_runs``):
the resume continues the compared conversational run."""
import dataclasses
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("trl")
from .example_runs import run_example, saved_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft_trl.py"
SGD = ["--optim", "sgd", "--lr", "0.5", "--optim-args", "momentum=0.9"]


def _run(tmp_path, name, *argv, ranks=1):
    return run_example(EXAMPLE, tmp_path, name, *argv, ranks=ranks, timeout=400)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """``(folder, losses)`` of each run, made once for the module: ``(data, "trl")`` TRL's own trainer in one
    process, ``(data, "flex")`` FlexSP on 4 ranks (the resume test continues the conversational one)."""
    made = {}

    def get(data, name):
        if (data, name) not in made:
            folder = tmp_path_factory.mktemp(f"{data}-{name}")
            argv = ("--no-flexsp",) if name == "trl" else ()
            made[data, name] = folder, _run(folder, name, *argv, "--data", data, *SGD, ranks=1 if name == "trl" else 4)
        return made[data, name]
    return get


@pytest.mark.parametrize("data", ["prompt-completion", "conversational"])
def test_flexsp_equals_trls_own_trainer(sft_runs, data):
    """SGD with momentum: the comparison measures the gradients. (TRL computes log-probabilities in fp32 even
    for an fp64 model; under AdamW that rounding in near-zero gradients moved weights by 3.7e-6 of their scale.)"""
    (trl_dir, plain), (flex_dir, flex) = sft_runs(data, "trl"), sft_runs(data, "flex")
    assert sorted(flex) == sorted(plain) == [1, 2, 3, 4]
    for step in plain:
        assert flex[step] == pytest.approx(plain[step], rel=1e-6)
    assert plain[1] != pytest.approx(plain[4], rel=1e-6)   # the curve moves: the comparison is not vacuous
    a, b = saved_params(flex_dir, "flex", 4), saved_params(trl_dir, "trl", 4)
    for key in b:
        assert float((a[key] - b[key]).abs().max()) <= 1e-6 * float(b[key].abs().max()), key


def test_resumed_sft_continues_bit_for_bit(sft_runs, tmp_path):
    """From the conversational FlexSP run's step-2 checkpoint: the momentum buffers (optimizer state), the
    scheduler and the loader's position resume too (the momentum changes step 3's update, so step 4's loss and
    the final weights differ if it were lost)."""
    flex_dir, flex = sft_runs("conversational", "flex")
    (tmp_path / "resumed").mkdir()
    shutil.copytree(flex_dir / "flex" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tmp_path, "resumed", "--data", "conversational", *SGD, "--resume", ranks=4)
    assert resumed[3] == flex[3] and resumed[4] == flex[4]
    a, b = saved_params(tmp_path, "resumed", 4), saved_params(flex_dir, "flex", 4)
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


@pytest.mark.parametrize("setting,pattern", [
    (dict(loss_type="dft"), "loss_type='dft' with flexsp=True"),
    (dict(activation_offloading=True), "activation_offloading=True with flexsp=True"),
])
def test_loss_settings_the_flexsp_step_would_not_apply_are_refused(tmp_path, setting, pattern):
    """TRL's loss settings live in its compute_loss / training_step, which the FlexSP step replaces: accepted,
    they would be silently dropped (a different loss than asked for). The Trainer's own (label smoothing, a
    compute_loss_func) are refused by FlexSPTrainer, which this class is (tests/hf/test_trainer.py)."""
    from datasets import Dataset

    from flexsp.hf.trainer import TrainerSetupError
    from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer
    from .models import build
    args = FlexSPSFTConfig(output_dir=str(tmp_path), flexsp=True, flexsp_tokens_per_rank=64, use_cpu=True,
                           report_to=[], bf16=False, **setting)
    with pytest.raises(TrainerSetupError, match=pattern) as info:
        FlexSPSFTTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
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


def _sft(tmp_path, name, model, flexsp=True, **settings):
    from datasets import Dataset

    from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer
    data = Dataset.from_dict({"input_ids": [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]})
    args = FlexSPSFTConfig(output_dir=str(tmp_path / name), flexsp=flexsp, flexsp_tokens_per_rank=64, use_cpu=True,
                           report_to=[], bf16=False, per_device_train_batch_size=3, max_steps=1, logging_steps=1,
                           save_strategy="no", optim="sgd", gradient_checkpointing=False, **settings)
    return FlexSPSFTTrainer(model=model, args=args, train_dataset=data, processing_class=_tokenizer())


def _logged(trainer):
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h)


def test_trls_router_coefficient_weighs_the_router_loss_and_the_raw_loss_is_logged(tmp_path):
    """SFTConfig(router_aux_loss_coef=...) replaces the model's own coefficient in TRL's loss: FlexSP's step weighs
    the router loss by it too (it kept the model's 0.001), and logs ``aux_loss`` unweighted, as TRL does."""
    from flexsp.hf.families import tiny_model
    flex = _sft(tmp_path, "flex", tiny_model("mixtral", output_router_logits=True), router_aux_loss_coef=5.0)
    assert flex.sp_model.router.coef == 5.0
    native = _sft(tmp_path, "trl", tiny_model("mixtral", output_router_logits=True), flexsp=False,
                  router_aux_loss_coef=5.0)
    got, want = _logged(flex), _logged(native)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-5)


def test_a_router_loss_trl_turns_off_is_off_under_flexsp(tmp_path):
    """A MoE config without ``router_aux_loss_coef`` (JetMoE's is ``aux_loss_coef``) gets TRL's 0.0: TRL adds no
    router loss but leaves ``output_router_logits`` on. FlexSP adds none either (it divided by zero at the first
    log): the same loss as with the router loss off."""
    from flexsp.hf.families import tiny_model
    flex = _sft(tmp_path, "on", tiny_model("jetmoe", output_router_logits=True))
    assert flex.router_aux_loss_coef == 0.0 and flex.sp_model.router is None
    off = _sft(tmp_path, "off", tiny_model("jetmoe", output_router_logits=False))
    got, want = _logged(flex), _logged(off)
    assert "aux_loss" not in got and got["loss"] == want["loss"]
