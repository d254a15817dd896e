"""Auxiliary losses coupled across the global batch (a MoE router's load balancing), for the step executor.

Such a loss is not a sum of per-token terms: it needs statistics of the whole batch (how many tokens
each expert got). A model that has one sets ``batch_coupled = True`` and implements

- ``shard_losses(input_ids, position_ids, labels, ctx) -> (lm_sum, term)``: the summed LM loss as
  ``shard_loss`` returns it, and a term with ``statistics`` (a detached float64 vector: this shard's
  share, summed over every rank and micro-batch) and ``loss(total)`` (this shard's differentiable part
  of the auxiliary loss given the batch's summed statistics; the parts of all shards sum to the loss);
- ``batch_statistics(input_ids, position_ids, ctx)``: the same statistics from a forward without
  gradients (no LM head).

The statistics must be summed before the first backward. With one micro-batch they come from the
step's own forward (one all-reduce between forward and backward). With several, every rank first
runs each of its micro-batches forward without gradients (``prepass``: about a third more compute for
that step), then one all-reduce; idle ranks run the executor's one-token dummy, so FSDP's collectives
stay in step. The term is added to the LM loss apart, so a change of the LM loss's normalisation
does not touch it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from flexsp.runtime.pool import GroupPool


def batch_coupled(model: Any) -> bool:
    """Whether ``model`` has a batch-coupled auxiliary loss this step must compute."""
    return bool(getattr(model, "batch_coupled", False)) and callable(getattr(model, "shard_losses", None))


class BatchCoupled:
    """One step's batch-coupled auxiliary loss: the summed statistics, then each shard's term."""

    def __init__(self, model: Any, pool: GroupPool, idle: Callable[[], Any]) -> None:
        self.model, self.pool, self.idle = model, pool, idle
        self.total: torch.Tensor | None = None

    def _reduce(self, stats: torch.Tensor) -> torch.Tensor:
        stats = stats.detach().to(torch.float64).clone()
        if self.pool.world_size > 1:
            dist.all_reduce(stats)
        return stats

    def prepass(self, work: Sequence[Any]) -> None:
        """Every micro-batch of this rank forward without gradients; the world's summed statistics."""
        stats = None
        with torch.no_grad():
            for w in work:
                d = w if w is not None else self.idle()
                s = self.model.batch_statistics(d.input_ids, d.position_ids, d.ctx)
                s = s * 0 if w is None else s
                stats = s if stats is None else stats + s
        self.total = self._reduce(stats)

    def losses(self, w: Any, normalise: Callable[[torch.Tensor], torch.Tensor], *,
               idle: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(``normalise(LM sum)`` + this shard's auxiliary term, the term) for micro-batch inputs ``w``."""
        lm, term = self.model.shard_losses(w.input_ids, w.position_ids, w.labels, w.ctx)
        if self.total is None:   # one micro-batch: this forward's statistics are the batch's
            self.total = self._reduce(term.statistics * (0 if idle else 1))
        aux = term.loss(self.total.to(term.statistics.device))
        if idle:
            aux = aux * 0.0
        return normalise(lm) + aux, aux
