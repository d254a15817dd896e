"""Which targets of a row carry loss: its ``labels`` column or TRL's masks, read and checked once per row.

The conventions are Hugging Face's and TRL's:

- ``labels``: aligned with ``input_ids``, unshifted (the model predicts ``labels[t + 1]`` from token ``t``),
  ``-100`` = no loss; any ids of the vocabulary, not only copies of ``input_ids``;
- ``completion_mask`` (TRL prompt-completion data) and ``assistant_masks`` (TRL ``assistant_only_loss``):
  1 = the token is a target, 0 = it is not (the prompt, the user's turns).

A row may carry several: a token is a target where every mask says 1 (TRL's collator applies both masks),
and ``labels`` beside a mask must agree with it (-100 exactly where the mask is 0, from the second token on:
the first is never a target), since two columns that disagree mean the dataset was built wrong. ``read_targets`` turns a row into the per-token targets the
packing step shifts (``flexsp.runtime.sp.tokens.next_token_labels``, the one place labels are laid out)
and counts its supervised targets on the host, so the step's denominator needs no device read.
Per-token loss weights are not supported (a target is in or out).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flexsp.errors import FlexSPError
from flexsp.runtime.sp.tokens import IGNORE_INDEX

LABELS = "labels"
MASKS = ("completion_mask", "assistant_masks")
SUPERVISION = (LABELS, *MASKS)


class LabelsError(FlexSPError):
    """A row's ``labels`` or loss mask cannot be what the model trains on (length, values, disagreement)."""


def _column(value: Any, name: str, where: str, n: int) -> torch.Tensor:
    """One supervision column as a 1-D int64 tensor of ``n`` entries."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise LabelsError(f"{where}, column {name!r}: cannot be read as integers: {exc}") from None
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise LabelsError(f"{where}, column {name!r}: must be a 1-D sequence of integers, got shape "
                          f"{tuple(t.shape)} dtype {t.dtype}")
    if t.numel() != n:
        raise LabelsError(f"{where}, column {name!r}: {t.numel()} entries but input_ids has {n}")
    return t.to(torch.long)


def _first(bad: torch.Tensor) -> int:
    return int(bad.nonzero()[0, 0])


def read_targets(columns: Mapping[str, Any], ids: torch.Tensor, where: str,
                 vocab_size: int | None = None) -> tuple[torch.Tensor | None, int]:
    """``(targets, supervised)`` of one row whose tokens are ``ids`` (1-D int64).

    ``targets`` is ``None`` when the row has no supervision column (every next token is a target);
    otherwise aligned with ``ids``, ``IGNORE_INDEX`` where no loss. ``supervised``: targets that carry loss
    (positions 1.. only: the first token is never predicted). ``where`` names the row in errors
    (``"dataset item 7"``); ``vocab_size`` bounds labels (ids outside it would fail deep in the loss)."""
    n = int(ids.numel())
    present = [c for c in SUPERVISION if columns.get(c) is not None]
    if not present:
        return None, max(0, n - 1)
    keep: torch.Tensor | None = None
    labels = None
    if LABELS in present:
        labels = _column(columns[LABELS], LABELS, where, n)
        real = labels.ne(IGNORE_INDEX)
        bad = real & (labels.lt(0) | (labels.ge(vocab_size) if vocab_size is not None else False))
        if bool(bad.any()):
            j = _first(bad)
            span = f"the vocabulary 0..{vocab_size - 1}" if vocab_size is not None else "the ids >= 0"
            raise LabelsError(f"{where}, column 'labels': position {j} holds {int(labels[j])}, outside {span} "
                              f"and not {IGNORE_INDEX} (no loss)")
        keep = real
    for name in present:
        if name == LABELS:
            continue
        mask = _column(columns[name], name, where, n)
        bad = mask.ne(0) & mask.ne(1)
        if bool(bad.any()):
            j = _first(bad)
            raise LabelsError(f"{where}, column {name!r}: position {j} holds {int(mask[j])}; a loss mask holds 0 or 1")
        on = mask.eq(1)
        if labels is not None:
            differ = on.ne(labels.ne(IGNORE_INDEX))
            differ[0] = False   # the first token is never a target: what either says there changes no loss
            if bool(differ.any()):
                j = _first(differ)
                raise LabelsError(f"{where}: columns 'labels' and {name!r} disagree at position {j} (label "
                                  f"{int(labels[j])}, mask {int(mask[j])}); give one, or make labels -100 exactly "
                                  f"where the mask is 0")
        keep = on if keep is None else keep & on
    assert keep is not None
    base = labels if labels is not None else ids.to(torch.long)
    targets = torch.where(keep, base, torch.full_like(base, IGNORE_INDEX))
    return targets, int(keep[1:].sum())
