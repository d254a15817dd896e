"""examples/hf_trainer.py: HF Trainer with FlexSP on 4 gloo ranks (torchrun) against the plain Trainer in
one process on the same global batches, and a resumed FlexSP run against the uninterrupted one.

Tolerances (fp64 model): the logged losses go through the Trainer's fp32 loss accumulator, so they
agree to 1e-6 relative (measured: one fp32 ulp, ~1e-7); the parameters after 4 AdamW steps agree to
1e-6 of each tensor's largest entry (measured 2e-7: Adam divides by sqrt(v), which turns fp64 rounding
noise in near-zero gradients into relative noise of the update). The resumed run is compared exactly (bitwise parameters, equal losses)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")
from scripts import experiment  # noqa: E402

from .example_runs import run_example, saved_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"


def _run(tmp_path, name, *argv, ranks=1):
    return run_example(EXAMPLE, tmp_path, name, *argv, ranks=ranks)


def test_trainer_with_flexsp_equals_plain_trainer_and_resumes_exactly(tmp_path):
    plain = _run(tmp_path, "plain", "--no-flexsp")
    flex = _run(tmp_path, "flex", "--run-dir", str(tmp_path / "telemetry"), ranks=4)
    assert sorted(flex) == sorted(plain) == [1, 2, 3, 4]
    for step in plain:
        assert flex[step] == pytest.approx(plain[step], rel=1e-6)
    assert plain[1] != pytest.approx(plain[4], rel=1e-6)   # the curve moves: the comparison is not vacuous
    a, b = saved_params(tmp_path, "flex", 4), saved_params(tmp_path, "plain", 4)
    for key in b:
        assert float((a[key] - b[key]).abs().max()) <= 1e-6 * float(b[key].abs().max()), key
    records = [json.loads(line) for line in (tmp_path / "telemetry" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["seconds"] > 0 and r["micro_batches"] for r in records)   # as the loop writes
    saved = json.loads((tmp_path / "flex" / "checkpoint-2" / "flexsp_loader.json").read_text())
    assert (saved["epoch"], saved["index"], saved["step"]) == (0, 2, 2)   # the next unseen global batch

    # Resume from step 2 of the FlexSP run in a fresh directory and fresh processes.
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "flex" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(tmp_path, "resumed", "--resume", ranks=4)
    assert resumed[3] == flex[3] and resumed[4] == flex[4]
    a, b = saved_params(tmp_path, "resumed", 4), saved_params(tmp_path, "flex", 4)
    assert all(torch.equal(a[key], b[key]) for key in b)


@pytest.mark.parametrize("settings,pattern", [
    (dict(gradient_accumulation_steps=2, flexsp_tokens_per_rank=64), "one planned global batch is one optimizer step"),
    (dict(), "needs flexsp_tokens_per_rank"),
    (dict(fp16=True, flexsp_tokens_per_rank=64), "fp16=True with flexsp=True: fp16 needs loss scaling"),
    (dict(label_smoothing_factor=0.1, flexsp_tokens_per_rank=64), "label_smoothing_factor=0.1 with flexsp=True"),
])
def test_settings_flexsp_cannot_run_are_named(tmp_path, settings, pattern):
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError
    from .models import build
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[], **settings)
    with pytest.raises(TrainerSetupError, match=pattern):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))


def test_a_custom_loss_function_is_refused_not_silently_dropped(tmp_path):
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError
    from .models import build
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64)
    with pytest.raises(TrainerSetupError, match="compute_loss_func with flexsp=True"):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}),
                      compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)


def _refused(tmp_path, pattern, cls=None, settings=None, columns=None, **trainer_kw):
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError
    from .models import build
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64, **(settings or {}))
    data = Dataset.from_dict(columns or {"input_ids": [[1, 2, 3]]})
    with pytest.raises(TrainerSetupError, match=pattern) as info:
        (cls or FlexSPTrainer)(model=build("llama"), args=args, train_dataset=data, **trainer_kw)
    assert "\n" not in str(info.value)


def test_hooks_and_settings_the_flexsp_step_would_skip_are_refused(tmp_path):
    """What the plain Trainer would apply and FlexSP's step never calls: a collator that rewrites the batch,
    a subclass's compute_loss, NEFTune's noise (sized by a padded row, here a packed shard)."""
    from transformers import DataCollatorForLanguageModeling

    from flexsp.hf.trainer import FlexSPTrainer

    class Halved(FlexSPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0.5 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    _refused(tmp_path, "data_collator=<lambda> with flexsp=True", data_collator=lambda rows: rows)
    _refused(tmp_path, "Halved.compute_loss with flexsp=True", cls=Halved)
    _refused(tmp_path, "neftune_noise_alpha=5.0 with flexsp=True", settings=dict(neftune_noise_alpha=5.0))
    # every input token as a label, which a labels column would contradict
    lm = DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    _refused(tmp_path, "data_collator=DataCollatorForLanguageModeling", data_collator=lm,
             columns={"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]})
    # it takes every token equal to the pad id out of the loss (pad = eos is common): FlexSP would train them
    _refused(tmp_path, "data_collator=DataCollatorForLanguageModeling", data_collator=lm)


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "a": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")


def test_padding_collators_and_the_defaults_are_accepted_and_tokens_seen_are_counted(tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    from .models import build
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6], [7, 8, 9]]})
    no_pad = _tokenizer()
    no_pad.pad_token = None
    for collator in (None, DataCollatorWithPadding(_tokenizer()), DataCollatorForLanguageModeling(no_pad, mlm=False)):
        args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                       flexsp_tokens_per_rank=64, per_device_train_batch_size=3, max_steps=1,
                                       include_num_input_tokens_seen="all", save_strategy="no")
        trainer = FlexSPTrainer(model=build("llama"), args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    assert trainer.state.num_input_tokens_seen == 9   # the batch's tokens (was 0: no input_ids key to count)


def test_trainer_under_torchrun_joins_the_launch_world(tmp_path):
    """docs/huggingface.md's arguments (no use_cpu) under a 2-rank gloo torchrun: the Trainer sees a
    world of 2 (#38.3: each rank used to train as a world of one, logging and saving twice)."""
    launcher, env = experiment("launch").torchrun(2)
    proc = subprocess.run([*launcher, str(ROOT / "tests" / "hf" / "trainer_world.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["world_size"] for s in seen] == [2, 2] and [s["process_index"] for s in seen] == [0, 1]
    assert all(s["pool_closed_after_train"] for s in seen)   # a second train() would otherwise leave them behind
    assert all(s["parallel_mode"] == "ParallelMode.DISTRIBUTED" and s["dist_world"] == s["loader_world"] == 2
               for s in seen)
    assert [s["should_save"] for s in seen] == [True, False]   # one rank writes checkpoint-2/
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in proc.stdout + proc.stderr


def test_a_trainer_world_other_than_the_launch_is_refused(tmp_path, monkeypatch):
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError
    from .models import build
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, flexsp_tokens_per_rank=64, report_to=[])
    assert args.use_cpu == (not torch.cuda.is_available()) and args.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")   # as if launched on 2 ranks that the Trainer did not join
    with pytest.raises(TrainerSetupError, match="world of 1 .* WORLD_SIZE=2"):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))


def test_the_trainers_mixed_precision_is_the_steps_compute_dtype(tmp_path):
    """bf16=True on an fp32 model: the FlexSP step autocasts to bf16 (the Trainer's own autocast wraps
    compute_loss, which the step never calls, so the step used to compute in fp32: #35.4's silent fp32)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "hf" / "trainer_dtype.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "compute dtype: torch.bfloat16" in proc.stdout


@pytest.mark.parametrize("content, pattern", [
    ("[1]", "must be a JSON object, got list"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"epoch": ' + "9" * 5000 + "}", "not valid JSON"),
])
def test_a_damaged_loader_state_in_a_checkpoint_is_one_line(tmp_path, content, pattern):
    """The checkpoint's ``flexsp_loader.json`` is read with the bounded reader, before the loader is built."""
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError
    from .models import build
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "flexsp_loader.json").write_text(content)
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64)
    trainer = FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    with pytest.raises(TrainerSetupError, match=f"flexsp_loader.json.*{pattern}"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_a_run_dir_for_a_model_the_spec_cannot_describe_records_without_flops(tmp_path):
    """Gemma 4's full layers have their own head size, which a ModelSpec cannot hold: ``spec_from_hf_config``
    refuses it in one line, and ``flexsp_run_dir`` still records its steps (without model FLOPs) instead of
    failing the run with transformers' traceback."""
    from datasets import Dataset

    from flexsp.errors import CostModelError
    from flexsp.hf.families import tiny_model
    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    from flexsp.plan.specs import spec_from_hf_config
    from flexsp.telemetry.records import read_records
    model = tiny_model("gemma4_text")
    with pytest.raises(CostModelError, match=r"layers differ in \['head_dim'\].*cannot describe gemma4_text"):
        spec_from_hf_config(model.config)
    vocab = model.config.get_text_config().vocab_size
    data = Dataset.from_dict({"input_ids": [[(3 * i + j) % (vocab - 1) + 1 for j in range(n)]
                                            for i, n in enumerate([40, 12, 30, 9])]})
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=128, per_device_train_batch_size=4, max_steps=1,
                                   save_strategy="no", flexsp_run_dir=str(tmp_path / "run"))
    with pytest.warns(UserWarning, match="no model FLOPs"):
        FlexSPTrainer(model=model, args=args, train_dataset=data).train()
    assert [r["step"] for r in read_records(tmp_path / "run")] == [0]


def test_the_planning_rank_pays_the_solvers_first_call_costs_at_construction(tmp_path, monkeypatch):
    """The Trainer takes its first step a few milliseconds after its loader starts, so the solver's imports and
    numpy's lazy ones (15 ms) are paid when the Trainer is built, not inside the first step's wait."""
    from datasets import Dataset

    import flexsp.data.planning as planning
    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    from .models import build
    calls = []
    monkeypatch.setattr(planning, "warm_solver", lambda: calls.append("warm"))
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64, per_device_train_batch_size=1, max_steps=1,
                                   save_strategy="no")
    FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))
    assert calls == ["warm"]
    monkeypatch.undo()
    planning.warm_solver.cache_clear()   # once a process: an earlier test may have warmed it already
    planning.warm_solver()   # the real one plans a made-up batch without error


def test_the_first_step_is_prepared_before_the_trainer_takes_it(tmp_path):
    """The Trainer takes its first step a few milliseconds after ``get_train_dataloader``, after set-up that
    holds the GIL: the example's first step waited 20-25 ms of its 85 ms for the loader. The loader it returns
    has the first step prepared already, so the loop's first step waits for nothing."""
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    from .models import build
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64, per_device_train_batch_size=2, max_steps=1,
                                   save_strategy="no")
    data = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]})
    trainer = FlexSPTrainer(model=build("llama"), args=args, train_dataset=data)
    trainer.is_in_train = True   # as train() sets it before asking (outside train() it does not wait)
    try:
        stream = trainer.get_train_dataloader()
        assert trainer.flexsp_loader._ahead.done()
        first = next(iter(stream))
    finally:
        trainer.flexsp_loader.close()
    step = next(iter(first.values()))
    assert step.plan_wait + step.load_seconds < 0.05 and trainer.flexsp_loader.stats.prefetched == 1


@pytest.mark.parametrize("world, local, heads, degrees", [(12, 6, 32, (1, 2, 4)), (3, 3, 4, (1, 2)), (16, 8, 24, (1, 2, 4, 8)),
                                                          (8, 8, 32, (1, 2, 4, 8)), (24, 6, 12, (1, 2, 4))])
def test_the_trainer_plans_on_its_real_node_size(world, local, heads, degrees):
    """Two nodes of 6 ranks were planned as nodes of 8 (the node size rounded up to a power of two): a ClusterError
    naming gpus_per_node=8 before the first step. The cluster has the launch's node size, and the degrees are the
    pool's powers of two that split the heads, so a plan on it runs on the pool's groups."""
    import numpy as np

    from flexsp import plan_batch
    from flexsp.hf.trainer import default_cost, plan_topology
    from flexsp.plan.config import PlanConfig
    from .models import build
    cluster, got = plan_topology(world, local, heads)
    assert (cluster.num_gpus, cluster.gpus_per_node, got) == (world, local, degrees)
    cost = default_cost(build("llama").config, world, 64, cluster.gpus_per_node)
    plan = plan_batch(np.random.default_rng(0).integers(8, 64 * degrees[-1], size=4 * world), cost, cluster,
                      config=PlanConfig(degrees=got))
    assert {g.degree for mb in plan.micro_batches for g in mb.groups} <= set(degrees)


def test_datasets_flexsp_cannot_plan_are_refused_before_any_row_is_read(tmp_path):
    """A streamed dataset was read to its end before the loader refused it (an endless one never returned); an
    untokenized one failed with a bare KeyError; an empty row was blamed on a ``lengths`` argument never passed;
    TRL's image collator was refused as if the user had passed a collator."""
    from datasets import Dataset, IterableDataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments, TrainerSetupError, check_collator
    from .models import build

    def endless():
        while True:
            yield {"input_ids": [1, 2, 3]}

    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64, max_steps=1, save_strategy="no")
    with pytest.raises(TrainerSetupError, match="needs a map-style train_dataset .* got IterableDataset"):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=IterableDataset.from_generator(endless))

    class Stream(torch.utils.data.IterableDataset):   # a length, and the base class's (raising) __getitem__
        def __iter__(self):
            return endless()

        def __len__(self):
            return 10

    with pytest.raises(TrainerSetupError, match="needs a map-style train_dataset .* got Stream"):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=Stream())
    with pytest.raises(TrainerSetupError, match="the train_dataset is empty"):
        FlexSPTrainer(model=build("llama"), args=args, train_dataset=Dataset.from_dict({"input_ids": []}))
    _refused(tmp_path, r"needs rows with input_ids .* columns are \['text'\]: tokenize it first",
             columns={"text": ["a b c"]})
    trainer = FlexSPTrainer(model=build("llama"), args=args,
                            train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3], [], [4, 5]]}))
    with pytest.raises(TrainerSetupError, match=r"train_dataset row 1 has no tokens \(1 empty rows\)"):
        trainer.train()
    vision = type("DataCollatorForVisionLanguageModeling", (), {"__module__": "trl.trainer.sft_trainer"})
    with pytest.raises(TrainerSetupError, match="a dataset of images with flexsp=True: TRL builds the image inputs"):
        check_collator(vision(), Dataset.from_dict({"input_ids": [[1, 2, 3]]}))


@pytest.mark.parametrize("drop_last, steps", [(False, 3), (True, 2)])
def test_dataloader_drop_last_drops_the_epochs_partial_batch(tmp_path, drop_last, steps):
    """``dataloader_drop_last=True`` was ignored: 5 rows in batches of 2 made 3 steps, where the plain Trainer makes 2."""
    from datasets import Dataset

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    from .models import build
    args = FlexSPTrainingArguments(output_dir=str(tmp_path), flexsp=True, use_cpu=True, report_to=[],
                                   flexsp_tokens_per_rank=64, per_device_train_batch_size=2, num_train_epochs=1,
                                   save_strategy="no", dataloader_drop_last=drop_last)
    data = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12, 13]]})
    trainer = FlexSPTrainer(model=build("llama"), args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.global_step == steps
