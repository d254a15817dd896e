"""Split a dataset into global batches, epoch by epoch, deterministically from a seed.

An epoch is a permutation of the dataset (``numpy`` generator seeded by ``(seed, epoch)``) cut into
batches of ``batch_size`` sequences or of at most ``max_tokens`` tokens. The cut is a pure function
of (lengths, config, epoch), so a resumed run only needs ``(epoch, index)`` to continue where it
stopped, and every kept sequence appears in exactly one batch of its epoch.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from flexsp.data.config import LoaderConfig
from flexsp.data.errors import LoaderError


@dataclass(frozen=True)
class GlobalBatch:
    """One step's sequences: ``indices`` into the dataset, in the order the plan's seq ids refer to."""

    epoch: int
    index: int               # position of the batch in its epoch
    indices: tuple[int, ...]
    last: bool               # the epoch's final batch
    skipped: int             # too-long sequences left out of this epoch (policy "skip")

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.index)


class EpochBatches:
    """The global batches of each epoch for one dataset's ``lengths`` under ``config``.

    ``capacity`` is the most tokens one sequence may have: what the largest SP group holds.
    """

    def __init__(self, lengths: np.ndarray, config: LoaderConfig, capacity: float) -> None:
        self.lengths, self.config, self.capacity = lengths, config, capacity
        self.too_long = np.flatnonzero(lengths > capacity)
        # what a loader state records of the left-out set (``FlexSPLoader.left_out``): fixed with it, so made once
        self.too_long_digest = [int(self.too_long.size), zlib.crc32(self.too_long.astype(np.int64).tobytes())]
        self._cache: dict[int, list[tuple[int, ...]]] = {}   # the latest epochs (loop and planner thread)

    def check_too_long(self) -> None:
        """Apply ``on_too_long="error"``: name the first sequence no group can hold."""
        if self.config.on_too_long == "error" and self.too_long.size:
            i = int(self.too_long[0])
            raise LoaderError(
                f"dataset sequence {i} has {int(self.lengths[i])} tokens but the largest SP group holds "
                f"{self.capacity:.0f} ({self.too_long.size} sequence(s) are too long); truncate them, "
                f"give the cluster more capacity, or pass on_too_long='skip' to leave them out (counted)")

    def epoch(self, epoch: int) -> list[tuple[int, ...]]:
        """The batches of ``epoch`` as tuples of dataset indices (cached for the latest epoch)."""
        cached = self._cache.get(epoch)
        if cached is not None:
            return cached
        self.check_too_long()
        n = self.lengths.size
        order = (np.random.default_rng([self.config.seed, epoch]).permutation(n) if self.config.shuffle
                 else np.arange(n))
        if self.too_long.size:
            order = order[self.lengths[order] <= self.capacity]
        if order.size == 0:
            raise LoaderError(f"every one of the {n} sequences is too long for the cluster "
                              f"(largest group holds {self.capacity:.0f} tokens)")
        if self.config.batch_size is not None:
            size = self.config.batch_size
            batches = [tuple(int(i) for i in order[s:s + size]) for s in range(0, order.size, size)]
            if self.config.drop_last and len(batches[-1]) < size:
                batches.pop()
                if not batches:
                    raise LoaderError(f"drop_last=True leaves no batch: the {order.size} sequences of an epoch are "
                                      f"fewer than one batch of {size}")
        else:
            batches = _token_budget(order, self.lengths, self.config.max_tokens)
        self._cache = {e: b for e, b in self._cache.items() if e >= epoch - 1}
        self._cache[epoch] = batches
        return batches

    def count(self, epoch: int) -> int:
        """Batches in ``epoch`` (with a token budget it can differ between epochs)."""
        return len(self.epoch(epoch))

    def iterate(self, epoch: int, index: int) -> Iterator[GlobalBatch]:
        """Every batch from ``(epoch, index)`` on, across epochs, forever."""
        while True:
            batches = self.epoch(epoch)
            if index > len(batches):
                raise LoaderError(f"cannot resume at batch {index} of epoch {epoch}: it has {len(batches)} batches")
            skipped = int(self.too_long.size)
            for i in range(index, len(batches)):
                yield GlobalBatch(epoch, i, batches[i], last=i == len(batches) - 1, skipped=skipped)
            epoch, index = epoch + 1, 0


def _token_budget(order: np.ndarray, lengths: np.ndarray, max_tokens: int) -> list[tuple[int, ...]]:
    """Cut ``order`` greedily: a batch closes when the next sequence would exceed the budget.

    A sequence longer than the budget on its own still forms a batch of one (it is never dropped).
    """
    batches, current, tokens = [], [], 0
    for i, n in zip(order.tolist(), lengths[order].tolist()):
        if current and tokens + n > max_tokens:
            batches.append(tuple(current))
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        batches.append(tuple(current))
    return batches
