"""Which targets of a row carry loss: its ``labels`` column or TRL's masks, read and checked once per row.

The conventions are Hugging Face's and TRL's:

- ``labels`` (or ``label_ids``, which Hugging Face's collators read as ``labels``): aligned with ``input_ids``,
  unshifted (the model predicts ``labels[t + 1]`` from token ``t``), ``-100`` = no loss; any ids of the
  vocabulary, not only copies of ``input_ids``;
- ``completion_mask`` (TRL prompt-completion data) and ``assistant_masks`` (TRL ``assistant_only_loss``):
  1 = the token is a target, 0 = it is not (the prompt, the user's turns).

A row may carry several: a token is a target where every mask says 1 (TRL's collator applies both masks),
and ``labels`` beside a mask must agree with it (-100 exactly where the mask is 0, from the second token on:
the first is never a target), since two columns that disagree mean the dataset was built wrong. ``read_targets`` turns a row into the per-token targets the
packing step shifts (``flexsp.runtime.sp.tokens.next_token_labels``, the one place labels are laid out)
and counts its supervised targets on the host, so the step's denominator needs no device read (a column
given on a device is read back once, then checked and counted on the host; the targets go where the tokens are).
Per-token loss weights are not supported (a target is in or out).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flexsp.errors import FlexSPError
from flexsp.runtime.sp.tokens import IGNORE_INDEX
from flexsp.runtime.transfer import to_device

LABELS = "labels"
LABEL_IDS = "label_ids"   # Hugging Face's other name for labels (its collators rename it; ``labels`` wins beside it)
MASKS = ("completion_mask", "assistant_masks")
SUPERVISION = (LABELS, LABEL_IDS, *MASKS)


class LabelsError(FlexSPError):
    """A row's ``labels`` or loss mask cannot be what the model trains on (length, values, disagreement)."""


# near misses of the supervision columns: a row holding one (as long as its input_ids) was meant to carry loss
# targets, and reading none would silently train every token
NEAR_MISSES = {"label": LABELS, "completion_masks": "completion_mask", "assistant_mask": "assistant_masks"}
PADDING = "attention_mask"   # Hugging Face's padding mask: FlexSP packs unpadded sequences
# a row that already packs several documents: positions restarting inside it (Hugging Face then keeps the documents
# apart), or TRL's lengths of its packed documents
POSITIONS, DOCUMENT_LENGTHS = "position_ids", "seq_lengths"


def integers(value: Any, what: str, error: type[FlexSPError], *, allow_bool: bool = False) -> torch.Tensor:
    """``value`` as a 1-D int64 tensor, refusing what the cast would change: floats (truncated), booleans (read
    as 0 and 1; allowed for masks), unsigned values above int64 (wrapped: 2**64 - 100 would become -100) and
    meta tensors (no values)."""
    t = _tensor(value, what, error, "integers")
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or (t.dtype == torch.bool and not allow_bool):
        raise error(f"{what}: must be a 1-D sequence of integers, got shape {tuple(t.shape)} dtype {t.dtype}")
    if (t.dtype == torch.uint64 and t.device.type == "cpu" and type(t) is torch.Tensor   # values readable here
            and bool(t.view(torch.int64).lt(0).any())):   # the bits of a value >= 2**63
        raise error(f"{what}: holds a value above {torch.iinfo(torch.int64).max}")
    return t.to(torch.long)


def _tensor(value: Any, what: str, error: type[FlexSPError], kind: str) -> torch.Tensor:
    """``value`` as a tensor with values to read (not a meta tensor); ``kind`` names what it should hold."""
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise error(f"{what}: cannot be read as {kind}: {exc}") from None
    if t.is_meta:
        raise error(f"{what}: a meta tensor holds no values")
    return t


def out_of_vocabulary(ids: torch.Tensor, vocab_size: int | None, where: str, error: type[FlexSPError]) -> None:
    """Refuse token ids outside ``0..vocab_size - 1`` (only negative ones when the vocabulary is unknown): the
    embedding would fail on them inside the step, after its collectives started, on CUDA as a device assert.
    Checked on plain CPU tensors only (where datasets hold rows): on a device it would cost a host sync per row,
    and a tensor subclass (a fake tensor tracing the step, a DTensor) may hold no values to read."""
    if ids.device.type != "cpu" or type(ids) is not torch.Tensor:
        return
    outside = _outside(ids, vocab_size)
    if outside is not None:
        j, span = outside
        raise error(f"{where}: token {j} is {int(ids[j])}, outside {span}")


def _outside(values: torch.Tensor, vocab_size: int | None, checked: torch.Tensor | None = None
             ) -> tuple[int, str] | None:
    """The first position (among ``checked``, default all) whose value is no id of the vocabulary (negative, or
    at least ``vocab_size`` when it is known), and the ids that would be valid, in words; None when there is none."""
    bad = values.lt(0) | (values.ge(vocab_size) if vocab_size is not None else False)
    if checked is not None:
        bad &= checked
    if not bool(bad.any()):
        return None
    return _first(bad), f"the vocabulary 0..{vocab_size - 1}" if vocab_size is not None else "the ids >= 0"


def _column(value: Any, name: str, where: str, n: int) -> torch.Tensor:
    """One supervision column as a 1-D int64 tensor of ``n`` entries on the host (masks may be booleans): a
    column on a device is read back once here, and every check and the count run on the copy."""
    t = integers(value, f"{where}, column {name!r}", LabelsError, allow_bool=name not in (LABELS, LABEL_IDS))
    if t.numel() != n:
        raise LabelsError(f"{where}, column {name!r}: {t.numel()} entries but input_ids has {n}")
    return t.cpu()


def _sized(value: Any, n: int) -> bool:
    """Whether ``value`` is a sequence of ``n`` entries (a column aligned with the tokens), not a scalar."""
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        return False
    try:
        return len(value) == n
    except TypeError:
        return False


def check_columns(columns: Mapping[str, Any], n: int, where: str) -> None:
    """Refuse the columns that would silently change the loss if ignored: a near miss of a supervision column
    (``label`` as long as the tokens: every token would be trained), an ``attention_mask`` with zeros
    (padding inside the sequence: FlexSP packs sequences unpadded, so the padding would be trained on), and a
    row that already packs several documents (``position_ids`` restarting inside it, or TRL's ``seq_lengths``
    of more than one document): FlexSP would attend across them, where Hugging Face keeps them apart."""
    for name, meant in NEAR_MISSES.items():
        if name in columns and meant not in columns and _sized(columns[name], n):
            raise LabelsError(f"{where}: column {name!r} is as long as input_ids but FlexSP reads {meant!r}: rename "
                              f"it (as it is, it would be ignored and every token trained)")
    if columns.get(PADDING) is not None and _sized(columns[PADDING], n):
        mask = integers(columns[PADDING], f"{where}, column {PADDING!r}", LabelsError, allow_bool=True)
        if bool(mask.eq(0).any()):
            raise LabelsError(f"{where}: column {PADDING!r} is 0 at position {_first(mask.eq(0))}: FlexSP packs "
                              f"sequences unpadded, so padding would be trained on; drop the padded tokens "
                              f"(and the column) before the loader")
    if columns.get(POSITIONS) is not None and _sized(columns[POSITIONS], n):
        positions = _numbers(columns[POSITIONS], f"{where}, column {POSITIONS!r}")   # 0.0..n-1 (pandas) is fine
        moved = positions.ne(torch.arange(n, dtype=torch.float64))
        if bool(moved.any()):
            raise LabelsError(f"{where}: column {POSITIONS!r} is {positions[_first(moved)].item():g} at position "
                              f"{_first(moved)}, not 0..{n - 1}: a row packing several documents, which FlexSP would "
                              f"run as one sequence (each attending to the ones before it); FlexSP packs rows itself, "
                              f"so give each document as its own row")
    documents = columns.get(DOCUMENT_LENGTHS)
    if documents is not None and not isinstance(documents, (str, bytes, Mapping)) and _count(documents) > 1:
        raise LabelsError(f"{where}: column {DOCUMENT_LENGTHS!r} lists {_count(documents)} documents packed in one "
                          f"row, which FlexSP would run as one sequence; FlexSP packs rows itself, so give each "
                          f"document as its own row (TRL: packing=False)")


def _numbers(value: Any, what: str) -> torch.Tensor:
    """A 1-D column of numbers (integers or floats) as float64 on the host."""
    t = _tensor(value, what, LabelsError, "numbers")
    if t.dim() != 1 or t.is_complex() or t.dtype == torch.bool:
        raise LabelsError(f"{what}: must be a 1-D sequence of numbers, got shape {tuple(t.shape)} dtype {t.dtype}")
    return t.detach().cpu().to(torch.float64)


def _count(value: Any) -> int:
    """Entries of a sequence-like column value (1 for a scalar)."""
    try:
        return len(value)
    except TypeError:
        return 1


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
    check_columns(columns, n, where)
    label_name = next((c for c in (LABELS, LABEL_IDS) if columns.get(c) is not None), None)
    present = [c for c in MASKS if columns.get(c) is not None]
    if label_name is None and not present:
        return None, max(0, n - 1)
    keep: torch.Tensor | None = None
    labels = None
    if label_name is not None:
        labels = _column(columns[label_name], label_name, where, n)
        real = labels.ne(IGNORE_INDEX)
        outside = _outside(labels, vocab_size, real)
        if outside is not None:
            j, span = outside
            raise LabelsError(f"{where}, column {label_name!r}: position {j} holds {int(labels[j])}, outside {span} "
                              f"and not {IGNORE_INDEX} (no loss)")
        keep = real
    for name in present:
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
                raise LabelsError(f"{where}: columns {label_name!r} and {name!r} disagree at position {j} (label "
                                  f"{int(labels[j])}, mask {int(mask[j])}); give one, or make labels -100 exactly "
                                  f"where the mask is 0")
        keep = on if keep is None else keep & on
    assert keep is not None
    # the targets live where the tokens do (a host mask beside device ids too); the count stays on the host
    keep_here = to_device(keep, ids.device)
    base = to_device(labels, ids.device) if labels is not None else ids.to(torch.long)
    targets = torch.where(keep_here, base, torch.full_like(base, IGNORE_INDEX))
    return targets, int(keep[1:].sum())
