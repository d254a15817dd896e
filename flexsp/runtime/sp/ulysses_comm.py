"""Ulysses communication: the autograd all-to-all, and the ``Exchange`` seam replay substitutes.

``all_to_all(x, group, scatter_dim, gather_dim)`` splits ``x`` into ``d`` chunks along
``scatter_dim``, sends chunk ``i`` to the group's rank ``i``, and concatenates what it receives along
``gather_dim`` in rank order. Its gradient is the same exchange with the two dims swapped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group``; identity when the group is None or of size 1."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[tokens/d, heads, dim]`` (a token shard, all heads) -> ``[tokens, heads/d, dim]``."""
    return all_to_all(x, group, scatter_dim=1, gather_dim=0)


def head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[tokens, heads/d, dim]`` -> ``[tokens/d, heads, dim]``: the inverse of ``seq_to_head``."""
    return all_to_all(x, group, scatter_dim=0, gather_dim=1)


def head_part(x: torch.Tensor, group: dist.ProcessGroup | None, rank: int | None = None) -> torch.Tensor:
    """The rows of a per-head tensor (attention sinks ``[heads]``) for the heads ``seq_to_head`` leaves on
    this rank: its ``rank``-th of ``d`` equal parts (``rank`` None: this process's rank in ``group``).
    Autograd carries the part's gradient back into its rows of ``x``; the other rows get zero here and
    their gradient from the ranks that hold them (the gradient reduction sums them)."""
    d = 1 if group is None else dist.get_world_size(group)
    if d == 1:
        return x
    if rank is None:
        rank = dist.get_rank(group)
    n = x.shape[0] // d
    return x.narrow(0, rank * n, n)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    d = dist.get_world_size(group)
    if x.shape[scatter_dim] % d:
        raise ValueError(f"all-to-all over {d} ranks needs dim {scatter_dim} divisible by {d}, got shape {tuple(x.shape)}")
    send = torch.stack(x.chunk(d, dim=scatter_dim)).contiguous()   # [d, ...]: chunk i goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


class Exchange(Protocol):
    """The two Ulysses trades one rank makes. Training uses ``AllToAllExchange``; ``flexsp.replay``
    substitutes a local stand-in that yields the same post-exchange shapes without a process group."""

    @property
    def degree(self) -> int: ...

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor: ...   # [tokens/d, heads, dim] -> [tokens, heads/d, dim]

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor: ...   # the inverse


@dataclass(frozen=True)
class AllToAllExchange:
    """The real exchange: an autograd all-to-all over the SP group (identity for None / size 1)."""

    group: dist.ProcessGroup | None

    @property
    def degree(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor:
        return seq_to_head(x, self.group)

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        return head_to_seq(x, self.group)
