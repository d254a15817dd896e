"""FlexSP inside Hugging Face ``Trainer``: one flag and a per-rank token budget::

    from flexsp.hf.trainer import FlexSPTrainer, FlexSPTrainingArguments
    args = FlexSPTrainingArguments(output_dir="run", flexsp=True, flexsp_tokens_per_rank=8192,
                                   per_device_train_batch_size=8, ...)   # 8 x world sequences per step
    FlexSPTrainer(model=model, args=args, train_dataset=ds).train()       # torchrun / accelerate launch

With ``flexsp=False`` it is the plain ``Trainer``. With ``flexsp=True`` FlexSP supplies:

- **data**: the train dataloader is a ``FlexSPLoader``; each global batch (``per_device_train_batch_size``
  x world sequences, shuffled with ``args.data_seed`` or ``args.seed``) is planned into SP groups of
  mixed degrees within ``flexsp_tokens_per_rank`` tokens per rank (or the profiled cost model
  ``flexsp_cost``), and each rank gets its packed per-rank ``Step`` (no collator, no padding);
- **attention**: ``prepare_model`` registers FlexSP's attention under the model's own key;
- **loss and gradients**: ``training_step`` runs the step's micro-batches through the runtime's
  ``StepExecutor`` (summed loss / the global batch's count of supervised targets: a ``labels`` column or
  TRL's ``completion_mask`` / ``assistant_masks`` say which, ``flexsp.runtime.labels``; gradients summed
  over the world), so one Trainer step equals HF's loss (``num_items_in_batch``) over the global batch on
  one device. TRL's ``SFTTrainer``: ``flexsp.hf.trl``. The
  Trainer keeps its optimizer, scheduler, clipping, logging and callbacks; the model is not wrapped
  in DDP (FlexSP reduces the gradients itself).
- **checkpoints**: the Trainer's own (``save_steps``, ``resume_from_checkpoint``), plus the loader's
  position in ``flexsp_loader.json`` in each checkpoint folder; a resumed run continues with the
  next unseen global batch (the Trainer's batch skipping is off: the loader state replaces it).

One global batch is one optimizer step: ``gradient_accumulation_steps`` must be 1.

Launch: ``torchrun --nproc_per_node=N train.py`` (or ``accelerate launch``). FlexSP runs on CUDA or on
CPUs (gloo); on a machine without CUDA, ``flexsp=True`` sets ``use_cpu=True``, which is what makes
the Trainer join torchrun's ranks there (without it every rank trains alone as a world of one, logs
every line and writes the same checkpoints). A Trainer whose world is not the launch's is refused.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from flexsp.errors import CostModelError, FlexSPError
from flexsp.inputs import read_json
from flexsp.hf.adapter import HFCausalLM
from flexsp.hf.features import check_supported
from flexsp.hf.mixers import ring_capable
from flexsp.hf.prepare import prepare_model
from flexsp.runtime.labels import SUPERVISION

LOADER_STATE = "flexsp_loader.json"
STEP_KEY = "flexsp_step"


class TrainerSetupError(FlexSPError):
    """The Trainer's settings cannot run under FlexSP (named setting and why)."""


@dataclass
class FlexSPArguments:
    """The FlexSP settings, defined once: mixed into ``TrainingArguments`` here and into TRL's ``SFTConfig``
    (``flexsp.hf.trl``). Put it first among the bases so its ``__post_init__`` runs before theirs."""

    flexsp: bool = field(default=False, metadata={"help": "plan each global batch into FlexSP SP groups"})
    flexsp_tokens_per_rank: int | None = field(default=None, metadata={
        "help": "tokens one rank can hold (activation budget); the largest group holds world x this"})
    flexsp_cost: str | None = field(default=None, metadata={
        "help": "cost model JSON from `flexsp profile` (default: a made-up one with flexsp_tokens_per_rank)"})
    flexsp_strategy: str = field(default="flexsp", metadata={"help": "planner strategy"})
    flexsp_time_limit: float = field(default=1.0, metadata={"help": "planner seconds per global batch"})
    flexsp_run_dir: str | None = field(default=None, metadata={
        "help": "record every step measured against its plan there (flexsp.telemetry; `flexsp report DIR`)"})
    flexsp_refit: bool = field(default=False, metadata={
        "help": "refit the cost model from measured group times and plan later steps with it (needs flexsp_run_dir)"})

    def __post_init__(self) -> None:
        # Without CUDA, FlexSP runs on CPUs; the Trainer (accelerate) sets up torchrun's ranks on CPUs
        # only with use_cpu, and otherwise runs each rank as a world of one.
        if self.flexsp and not self.use_cpu and not torch.cuda.is_available():
            self.use_cpu = True
        super().__post_init__()


@dataclass
class FlexSPTrainingArguments(FlexSPArguments, TrainingArguments):
    """``TrainingArguments`` with the FlexSP settings (``FlexSPArguments``)."""


class _Deferred:
    """The executor's optimizer: its step and zero_grad belong to the Trainer (which calls both)."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class StepStream:
    """The Trainer's train dataloader: the loader's per-rank ``Step``s as ``{"flexsp_step": step}``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[dict]:
        for step in self.loader:
            yield {STEP_KEY: step}

    def __len__(self) -> int:
        return self.loader.num_batches()


def check_overrides(cls: type) -> None:
    """Refuse a subclass's ``compute_loss``: the FlexSP step computes the loss itself and would never call it
    (the Trainer's and TRL's own are what the step reproduces)."""
    owner = next(c for c in cls.__mro__ if "compute_loss" in vars(c))
    if not owner.__module__.startswith(("transformers.", "trl.")):
        raise TrainerSetupError(f"{owner.__name__}.compute_loss with flexsp=True: the FlexSP step computes the "
                                f"summed next-token loss itself and would never call it; express per-token "
                                f"supervision as a labels column (-100: no loss) instead")


def check_collator(collator: Any, dataset: Any) -> None:
    """Refuse a data collator whose effect the FlexSP loader (which packs rows itself and never calls one) would
    drop. Accepted: the Trainer's and TRL's defaults and the padding-only collators, whose batches mean what
    FlexSP's do (labels column, else every next token)."""
    from transformers import (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding,
                              default_data_collator)
    name = getattr(collator, "__name__", type(collator).__name__)
    if collator is None or collator is default_data_collator or isinstance(collator, DataCollatorWithPadding):
        return
    if isinstance(collator, DataCollatorForSeq2Seq) and collator.label_pad_token_id == -100:
        return
    columns = set(getattr(dataset, "column_names", None) or ())
    pad = getattr(getattr(collator, "tokenizer", None), "pad_token_id", None)
    if isinstance(collator, DataCollatorForLanguageModeling) and not collator.mlm and not columns & set(SUPERVISION) \
            and pad is None:
        return   # labels = every input token, as FlexSP's loss without a labels column (it masks pad-id tokens too)
    if type(collator).__module__.startswith("trl.") and type(collator).__name__ == "DataCollatorForLanguageModeling":
        return   # TRL's own (its masks and labels reach FlexSP as dataset columns)
    if type(collator).__module__.startswith("trl.") and "Vision" in type(collator).__name__:
        raise TrainerSetupError(f"a dataset of images with flexsp=True: TRL builds the image inputs in its own "
                                f"{name}, which FlexSP's loader never calls (it trains on token rows); train on "
                                f"text rows (input_ids), or without flexsp")
    raise TrainerSetupError(f"data_collator={name} with flexsp=True: FlexSP's loader packs each planned batch "
                            f"itself and never calls a collator, so what it does would be dropped; leave "
                            f"data_collator unset and put per-token supervision in a labels column (-100: no loss)")


def check_dataset(dataset: Any) -> None:
    """Refuse, before any row is read, a train dataset FlexSP cannot plan: a streamed one (each global batch is
    planned from every sequence's length, so the loader needs ``len`` and indexing; a stream would be read to
    its end first) and one without an ``input_ids`` column (an untokenized ``text`` column)."""
    streamed = isinstance(dataset, torch.utils.data.IterableDataset)   # its base class has a (raising) __getitem__
    if streamed or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TrainerSetupError(f"flexsp=True needs a map-style train_dataset (len() and indexing: each global batch is "
                                f"planned from every sequence's length), got {type(dataset).__name__}; a streamed "
                                f"dataset must be materialised first")
    if len(dataset) == 0:
        raise TrainerSetupError("flexsp=True: the train_dataset is empty")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "input_ids" not in columns:
        raise TrainerSetupError(f"flexsp=True needs rows with input_ids (token ids); the train_dataset's columns are "
                                f"{sorted(columns)[:8]}: tokenize it first")


def row_lengths(dataset: Any) -> list[int]:
    """Every row's token count, each row named in the error when it has no tokens or is no token sequence."""
    from flexsp.data.source import item_length, read_item
    rows = iter(dataset) if hasattr(dataset, "__iter__") else (read_item(dataset, i) for i in range(len(dataset)))
    lengths = [item_length(row, i) for i, row in zip(range(len(dataset)), rows)]   # iterating: Arrow reads in batches
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise TrainerSetupError(f"train_dataset row {empty[0]} has no tokens ({len(empty)} empty rows): there is "
                                f"nothing to train on in it; drop empty rows")
    return lengths


def plan_topology(world: int, local: int, heads: int):
    """The Trainer's ``flexsp.Cluster``, nodes of ``local`` ranks (torchrun's ``LOCAL_WORLD_SIZE``: 12 ranks on
    nodes of 6 are two nodes of 6, any node size), and the SP degrees its plans use: the powers of two with a
    tile (those its ``GroupPool`` makes communicators for) that divide the model's SP ``heads`` (its groups are
    Ulysses groups; a degree of 3 or 6 would not split 32 heads)."""
    from flexsp.plan.cluster import Cluster, power_of_two_degrees, tileable
    cluster = Cluster(num_gpus=world, gpus_per_node=local)
    degrees = tuple(d for d in power_of_two_degrees(world) if tileable(d, world, local) and heads % d == 0)
    return cluster, degrees


def default_cost(config: Any, world: int, tokens_per_rank: int, gpus_per_node: int = 8):
    """A made-up cost model of the right shape for ``config`` (profile yours: ``flexsp profile --hf-config
    DIR``): ``flexsp.plan.token_budget.token_budget_cost`` of its text part's layers and hidden size, for a
    cluster of ``gpus_per_node``-GPU nodes."""
    from flexsp.plan.token_budget import token_budget_cost
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return token_budget_cost(text.num_hidden_layers, text.hidden_size, world, tokens_per_rank, gpus_per_node)


class FlexSPTrainer(Trainer):
    """``transformers.Trainer`` that trains under FlexSP when ``args.flexsp`` (see the module docstring)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.flexsp = bool(getattr(self.args, "flexsp", False))
        self.sp_model: HFCausalLM | None = None
        self.flexsp_loader = None
        self._executor = None
        self._telemetry = None
        self._pool = None   # the SP groups of this train() call: closed when it ends
        self._aux_sum, self._aux_steps = 0.0, 0
        if not self.flexsp:
            return
        args = self.args
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if args.world_size != launched:
            raise TrainerSetupError(
                f"the Trainer runs as a world of {args.world_size} (parallel_mode {args.parallel_mode.value}) but the "
                f"launch has WORLD_SIZE={launched} ranks: FlexSP plans each global batch over every launched rank; "
                f"use the launch's process group (use_cpu=True on CPUs, CUDA devices otherwise)")
        if args.gradient_accumulation_steps != 1:
            raise TrainerSetupError(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: under FlexSP one "
                                    f"planned global batch is one optimizer step; raise per_device_train_batch_size")
        if args.fp16:
            raise TrainerSetupError("fp16=True with flexsp=True: fp16 needs loss scaling, which the FlexSP step does "
                                    "not do (the gradient of a mean over the global batch's supervised tokens "
                                    "underflows in fp16); use bf16=True or fp32")
        # loss settings the FlexSP step would silently not apply: it computes the summed next-token loss itself
        if args.label_smoothing_factor:
            raise TrainerSetupError(f"label_smoothing_factor={args.label_smoothing_factor} with flexsp=True: the FlexSP "
                                    f"step computes the plain next-token loss; set it to 0")
        if self.compute_loss_func is not None:
            raise TrainerSetupError("compute_loss_func with flexsp=True: the FlexSP step computes its own loss (the "
                                    "summed next-token loss over the global batch's supervised targets) and would "
                                    "never call it")
        check_overrides(type(self))
        check_collator(self.data_collator, self.train_dataset)
        if args.neftune_noise_alpha:
            raise TrainerSetupError(f"neftune_noise_alpha={args.neftune_noise_alpha} with flexsp=True: NEFTune scales "
                                    f"its noise by one padded row's length, and under FlexSP a row is a whole packed "
                                    f"shard (the noise would shrink as shards grow); set it to None")
        if not args.average_tokens_across_devices and args.world_size > 1:
            raise TrainerSetupError("average_tokens_across_devices=False with flexsp=True: the FlexSP step's loss is "
                                    "the mean over the global batch's supervised tokens (how the plan splits the "
                                    "batch over ranks must not change it); set it to True")
        if args.flexsp_cost is None and not args.flexsp_tokens_per_rank:
            raise TrainerSetupError("flexsp=True needs flexsp_tokens_per_rank (tokens one rank holds) or flexsp_cost")
        if self.train_dataset is None:
            raise TrainerSetupError("flexsp=True needs a train_dataset of token sequences (rows with input_ids)")
        check_dataset(self.train_dataset)
        args.ignore_data_skip = True   # the loader's saved position replaces the Trainer's batch skipping
        self.sp_model = prepare_model(self.model)
        if args.process_index == 0:   # the planning rank: its loader starts right before the first step
            from flexsp.data.planning import warm_solver
            warm_solver()

    # --- data ----------------------------------------------------------------------------------
    def _build_loader(self):
        import torch.distributed as dist

        from flexsp.data import FlexSPLoader, LoaderConfig
        from flexsp.plan.cost import CostModel
        from flexsp.plan.config import PlanConfig
        from flexsp.runtime import GroupPool, StepExecutor
        args = self.args
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not dist.is_initialized():   # a world of one: the runtime's collectives need a process group
            from flexsp.runtime import init_distributed
            init_distributed()
        heads, _ = self.sp_model.sp_heads()
        if self.sp_model.linear_heads:   # a Gated DeltaNet hybrid: degrees must divide its value heads too
            heads = math.gcd(heads, self.sp_model.linear_heads)
        cluster, degrees = plan_topology(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), heads)
        if args.flexsp_cost:
            cost = CostModel.load(args.flexsp_cost)
        else:
            cost = default_cost(self.model.config, world, int(args.flexsp_tokens_per_rank), cluster.gpus_per_node)
        pool = self._pool = GroupPool(gpus_per_node=cluster.gpus_per_node)   # every power of two with a tile
        seed = args.data_seed if args.data_seed is not None else args.seed
        try:
            lengths = row_lengths(self.train_dataset)
        except FlexSPError as exc:   # a row without input_ids or tokens, named
            raise TrainerSetupError(str(exc)) from None
        check_supported(self.model, max(lengths))   # a sliding window is fine only if every sequence fits it
        text = self.model.config.get_text_config()
        plan = PlanConfig(strategy=args.flexsp_strategy, time_limit=args.flexsp_time_limit, max_degree=heads & -heads,
                          ulysses_only=not ring_capable(self.sp_model.mixers))
        if plan.degrees is None:   # unless the strategy names its own (``"flexsp[1,2]"``)
            plan = plan.replace(degrees=degrees)
        loader = FlexSPLoader(
            self.train_dataset, cost, cluster, pool=pool, device=self.args.device, lengths=lengths,
            vocab_size=getattr(text, "vocab_size", None),
            config=LoaderConfig(batch_size=args.per_device_train_batch_size * world, seed=seed,
                                drop_last=bool(args.dataloader_drop_last), plan=plan))
        if args.flexsp_run_dir is not None:   # the same per-step records as the project's own loop
            from flexsp.plan.specs import spec_from_hf_config
            from flexsp.telemetry import Telemetry
            try:
                spec = spec_from_hf_config(self.model.config)
            except CostModelError as exc:   # a model the planner's spec cannot describe (Gemma 4): records, no MFU
                warnings.warn(f"flexsp_run_dir: the records carry no model FLOPs (MFU): {exc}", stacklevel=2)
                spec = None
            self._telemetry = Telemetry(args.flexsp_run_dir, cost, spec=spec,
                                        device=args.device, refit=args.flexsp_refit, on_refit=loader.set_cost,
                                        log_every=max(0, int(args.logging_steps or 0)))
        elif args.flexsp_refit:
            raise TrainerSetupError("flexsp_refit=True needs flexsp_run_dir: the refit learns from the recorded steps")
        # the Trainer's mixed precision is the step's compute dtype: its autocast wraps compute_loss, which the
        # FlexSP step does not call, so without this an fp32 model under bf16=True would compute in fp32
        compute = torch.bfloat16 if args.bf16 else None   # fp16 is refused in __init__
        self._executor = StepExecutor(self.sp_model, _Deferred(), pool, cost=cost, param_dtype=compute,
                                      probe=None if self._telemetry is None else self._telemetry.probe)
        return loader

    def get_train_dataloader(self):
        if not self.flexsp:
            return super().get_train_dataloader()
        if self.flexsp_loader is None:
            self.flexsp_loader = self._build_loader()
        # At its (resumed) position, and inside train() prepared before the loop starts: the Trainer takes its first
        # step a few milliseconds after this, after set-up that holds the GIL, so the loader thread would prepare
        # little meanwhile (the example's first step waited 20-25 ms of its 85 ms for it). Started earlier, in
        # train(), the ranks' uneven set-up after it (0.2-0.5 s there) lands in the first step's collectives
        # instead. Outside train() it does not wait: a rank that asks alone would wait for peers that never come.
        self.flexsp_loader.start(wait=self.is_in_train)
        return StepStream(self.flexsp_loader)

    # --- model and step ------------------------------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.flexsp and training:
            return self.sp_model   # not DDP: FlexSP sums gradients over the world itself
        return super()._wrap_model(model, training, dataloader)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.flexsp:
            return super().training_step(model, inputs, num_items_in_batch)
        step = inputs[STEP_KEY]
        self.sp_model.train()
        result = self._executor.step(step)
        self._aux_sum += result.aux_loss   # the router part of the loss, logged apart
        self._aux_steps += 1
        return torch.tensor(result.loss, dtype=torch.float32, device=self.args.device)

    def log(self, logs: dict, *a: Any, **kw: Any) -> None:
        """The Trainer's log, plus ``aux_loss`` when the model adds a router loss: the load-balancing loss before
        its coefficient (as TRL logs it; the logged loss holds ``coef * aux_loss``), averaged like the loss."""
        if self.flexsp and "loss" in logs and self._aux_steps:
            if self.sp_model is not None and self.sp_model.router is not None:
                logs["aux_loss"] = round(self._aux_sum / self._aux_steps / self.sp_model.router.coef, 6)
            self._aux_sum, self._aux_steps = 0.0, 0
        super().log(logs, *a, **kw)

    def _track_num_input_tokens(self, inputs) -> None:
        """``include_num_input_tokens_seen``: the global batch's tokens (a packed step has no padding to count)."""
        if not self.flexsp:
            return super()._track_num_input_tokens(inputs)
        if self.args.include_num_input_tokens_seen not in ("no", False, None):
            self.state.num_input_tokens_seen += int(inputs[STEP_KEY].num_tokens)   # the same on every rank

    def floating_point_ops(self, inputs) -> int:
        if not self.flexsp:
            return super().floating_point_ops(inputs)
        params = sum(p.numel() for p in self.model.parameters())
        return 6 * params * int(inputs[STEP_KEY].num_tokens)

    # --- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.flexsp and self.flexsp_loader is not None and self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            (folder / LOADER_STATE).write_text(json.dumps(self.flexsp_loader.state_dict()))

    def train(self, resume_from_checkpoint: str | bool | None = None, *a: Any, **kw: Any):
        if self.flexsp and resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                path = get_last_checkpoint(self.args.output_dir)
                if path is None:
                    raise TrainerSetupError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint")
            state_file = Path(path) / LOADER_STATE
            if not state_file.is_file():
                raise TrainerSetupError(f"{path} has no {LOADER_STATE}: it was not saved by a FlexSP run, so the "
                                        f"loader's position is unknown")
            state = read_json(state_file, "loader state", TrainerSetupError)   # bounded: a checkpoint is untrusted
            if not isinstance(state, dict):
                raise TrainerSetupError(f"loader state {state_file} must be a JSON object, got {type(state).__name__}")
            if self.flexsp_loader is None:
                self.flexsp_loader = self._build_loader()
            try:
                self.flexsp_loader.load_state_dict(state)
            except FlexSPError as exc:
                raise TrainerSetupError(f"{state_file}: {exc}") from None
            resume_from_checkpoint = path
        try:
            return super().train(resume_from_checkpoint, *a, **kw)
        finally:
            if self._executor is not None:
                self._executor.close()
                self._executor = None
            if self.flexsp_loader is not None:
                self.flexsp_loader.close()
                self.flexsp_loader = None
            if self._telemetry is not None:
                self._telemetry.close()
                self._telemetry = None
            if self._pool is not None:   # after the executor and the loader built on it; a later train() builds anew
                self._pool.close()
                self._pool = None
