"""What the loader needs from a map-style dataset: its sequence lengths, and one item's tokens.

Lengths must be known before a batch can be planned. In order of preference (cheapest first):
an explicit ``lengths`` argument, a ``"length"`` column (Hugging Face ``datasets``: add one with
``ds.map(lambda x: {"length": len(x["input_ids"])})``, cached on disk), or ``len()`` of every item,
computed once, on the planning rank only, the first time lengths are needed (it reads every item).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from flexsp.data.errors import LoaderError
from flexsp.errors import LengthsError
from flexsp.plan.lengths import as_lengths

TOKENS_KEY = "input_ids"
LENGTH_COLUMN = "length"


def item_tokens(item: Any, index: int) -> Any:
    """The token sequence of one item: the item itself, or its ``input_ids`` when it is a mapping."""
    if isinstance(item, Mapping):
        if TOKENS_KEY not in item:
            raise LoaderError(f"dataset item {index} is a mapping without {TOKENS_KEY!r} "
                              f"(keys: {sorted(map(str, item))[:8]})")
        return item[TOKENS_KEY]
    return item


def item_length(item: Any, index: int) -> int:
    """Token count of one item (list, tuple, 1-D array or tensor, or a mapping with ``input_ids``)."""
    tokens = item_tokens(item, index)
    shape = getattr(tokens, "shape", None)
    if shape is not None and len(shape) != 1:
        raise LoaderError(f"dataset item {index} has token shape {tuple(shape)}; expected a 1-D sequence")
    try:
        return len(tokens)
    except TypeError:
        raise LoaderError(f"dataset item {index} is a {type(tokens).__name__}, not a token sequence "
                          f"(list, tensor, array, or a mapping with {TOKENS_KEY!r})") from None


def read_item(dataset: Sequence[Any], index: int) -> Any:
    """``dataset[index]``; the dataset's own failure (a disk, a decoder, a ``__len__`` longer than its items)
    is a ``LoaderError`` naming the item."""
    try:
        return dataset[index]
    except Exception as exc:
        raise LoaderError(f"dataset item {index} could not be read: {type(exc).__name__}: {exc}") from exc


def resolve_lengths(dataset: Sequence[Any], lengths: Any = None) -> np.ndarray:
    """Lengths of every item as int64: from ``lengths``, a ``"length"`` column, or ``len()`` per item."""
    n = len(dataset)
    if n == 0:
        raise LoaderError("the dataset is empty")
    if lengths is not None:
        source = "the lengths argument"
        values: Any = lengths
    elif LENGTH_COLUMN in (getattr(dataset, "column_names", None) or ()):
        source = f"the dataset's {LENGTH_COLUMN!r} column"
        values = np.asarray(list(dataset[LENGTH_COLUMN]))
    else:
        source = "len() of each item"
        values = np.fromiter((item_length(read_item(dataset, i), i) for i in range(n)), dtype=np.int64, count=n)
    try:
        arr = as_lengths(values, name="lengths")
    except LengthsError as exc:
        raise LoaderError(f"{source}: {exc}") from None
    if arr.size != n:
        raise LoaderError(f"{source} has {arr.size} entries but the dataset has {n} items")
    return arr
