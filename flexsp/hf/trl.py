"""TRL's ``SFTTrainer`` under FlexSP: TRL prepares the data, FlexSP batches, packs and steps.

    from flexsp.hf.trl import FlexSPSFTConfig, FlexSPSFTTrainer
    args = FlexSPSFTConfig(output_dir="run", flexsp=True, flexsp_tokens_per_rank=8192, max_length=32768, ...)
    FlexSPSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer).train()

``FlexSPSFTConfig`` is TRL's ``SFTConfig`` with the same ``flexsp*`` fields as ``FlexSPTrainingArguments``
(one definition: ``flexsp.hf.trainer.FlexSPArguments``). ``FlexSPSFTTrainer`` runs TRL's own dataset pipeline
(chat templates, tokenisation, ``completion_only_loss``, ``assistant_only_loss``, truncation to
``max_length``), which leaves each row with ``input_ids`` and the ``labels`` TRL built (-100 off the loss);
with ``flexsp=True`` FlexSP's loader then plans and packs each global batch and its step computes TRL's loss
(sum over the supervised targets / their count in the global batch). TRL's collator, ``packing`` and
``padding_free`` are what FlexSP replaces: asking for them with ``flexsp=True`` is refused, as are the loss
settings its own step would not apply (``loss_type`` other than ``"nll"``, ``label_smoothing_factor``,
``compute_loss_func``, ``activation_offloading``). TRL's per-batch
metrics (entropy, token accuracy) come from its ``compute_loss``, which the FlexSP step does not call: they are
not logged under FlexSP; the loss and FlexSP's telemetry (``flexsp_run_dir``) are.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flexsp.hf.trainer import FlexSPArguments, FlexSPTrainer, TrainerSetupError
from flexsp.runtime.labels import LABELS, MASKS

try:
    from trl import SFTConfig, SFTTrainer
except ModuleNotFoundError as exc:   # name the extra rather than a bare missing module
    raise ModuleNotFoundError(f"flexsp.hf.trl needs TRL ({exc}): pip install 'flexsp[trl]'", name=exc.name) from None


@dataclass
class FlexSPSFTConfig(FlexSPArguments, SFTConfig):
    """TRL's ``SFTConfig`` with the FlexSP settings (``FlexSPArguments``)."""


def check_sft_args(args: Any) -> None:
    """Refuse TRL settings whose job FlexSP does itself, before TRL builds anything."""
    if not getattr(args, "flexsp", False):
        return
    for name in ("packing", "padding_free"):
        if getattr(args, name, False):
            raise TrainerSetupError(f"{name}=True with flexsp=True: FlexSP already packs each planned global batch "
                                    f"(padding-free, per SP group); set {name}=False")
    # what TRL applies in its own compute_loss / training_step, which the FlexSP step replaces
    if getattr(args, "loss_type", "nll") != "nll":
        raise TrainerSetupError(f"loss_type={args.loss_type!r} with flexsp=True: the FlexSP step computes the "
                                f"next-token loss ('nll'); set loss_type='nll'")
    if getattr(args, "activation_offloading", False):
        raise TrainerSetupError("activation_offloading=True with flexsp=True: TRL applies it in its own training "
                                "step, which FlexSP's replaces; set it False (the planner's capacity model already "
                                "fits each group's activations in memory)")


class FlexSPSFTTrainer(FlexSPTrainer, SFTTrainer):
    """``trl.SFTTrainer`` that trains under FlexSP when ``args.flexsp`` (see the module docstring)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        args = kw.get("args", a[1] if len(a) > 1 else None)
        check_sft_args(args)
        super().__init__(*a, **kw)
        if self.flexsp:
            self.train_dataset = labels_only(self.train_dataset)
            router, coef = self.sp_model.router, float(self.router_aux_loss_coef)
            if router is not None:   # TRL weighs the router loss by its own coefficient (SFTConfig's, else the config's);
                # 0 (a config without router_aux_loss_coef, or 0 asked): TRL adds none, and neither do we
                self.sp_model.router = dataclasses.replace(router, coef=coef) if coef else None


def labels_only(dataset: Any) -> Any:
    """TRL's prepared rows with the ``labels`` it built as their only supervision: a mask column TRL chose not to
    apply (``completion_only_loss=False`` leaves ``completion_mask`` in place) must not reach FlexSP's loader,
    which would apply it (or refuse it as disagreeing with the labels); TRL's collator ignores it too."""
    columns = getattr(dataset, "column_names", None) or ()
    stale = [c for c in MASKS if c in columns]
    if LABELS in columns and stale:
        dataset = dataset.remove_columns(stale)
    return dataset
