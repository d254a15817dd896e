"""Zigzag token layout of a Ulysses x ring group: causal work split evenly over the ring.

A group of ``ulysses * ring`` ranks cuts every sequence into ``2 * ring`` chunks (as equal as integer
lengths allow) and gives ring rank ``i`` chunks ``i`` and ``2*ring - 1 - i``: an early, cheap chunk
and a late, expensive one, so under the causal mask every ring rank does the same work (a contiguous
split would give the last rank ``2*ring - 1`` times the first one's). A ring rank's tokens - per
sequence, its first chunk then its second - form its *ring shard*, padded at the tail to the longest
ring shard (rounded up to a multiple of ``ulysses``) so every point-to-point message has one shape.

The group's stream is the ring shards one after another; group rank ``ring_index * ulysses + j``
holds the ``j``-th contiguous slice of ring shard ``ring_index``. The Ulysses all-to-all over the
``ulysses`` consecutive ranks then rebuilds exactly one ring shard (for ``heads/ulysses`` heads), and
the ring runs over the ranks with the same ``j``.

Against ring rank ``i``, the K/V of ring rank ``j`` is (per sequence, which every rank derives from
the lengths alone): ``j == i`` causal over the whole shard; ``j < i`` all of j's *first* chunks for
all of i's queries, unmasked; ``j > i`` all of j's tokens for i's *second* chunks only, unmasked.
Everything here is host integers (numpy); ``RingTensors`` moves what the kernels need to the device
once per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from flexsp.errors import PlanError
from flexsp.runtime.sp.tokens import IGNORE_INDEX, PAD_TOKEN, Shard, next_token_labels
from flexsp.runtime.transfer import host_tensor, to_device


def chunk_bounds(lengths: np.ndarray, ring: int) -> np.ndarray:
    """``[n, 2*ring + 1]``: the 2*ring chunk bounds of each sequence, relative to its start."""
    return (np.arange(2 * ring + 1)[None, :] * lengths[:, None]) // (2 * ring)


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(start, start + size)`` for each pair, without a Python loop."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return offsets + np.arange(total)


def _cu(sizes: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))


@dataclass(frozen=True)
class ZigzagLayout:
    """Where each token of a ring group's sequences lives. Every rank of the group builds the same one."""

    lengths: tuple[int, ...]
    ulysses: int
    ring: int
    shard_tokens: int                         # tokens per ring shard, padding included
    first: tuple[np.ndarray, ...]             # per ring rank: first-chunk length of each sequence
    second: tuple[np.ndarray, ...]            # per ring rank: second-chunk length of each sequence

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def rank_tokens(self) -> int:
        """Tokens each group rank holds (its slice of a ring shard)."""
        return self.shard_tokens // self.ulysses

    def real_tokens(self, ring_rank: int) -> int:
        return int(self.first[ring_rank].sum() + self.second[ring_rank].sum())

    def cu_local(self, j: int) -> tuple[int, ...]:
        """Sequence bounds of ring shard ``j`` (both chunks of each sequence, in order)."""
        return _cu(self.first[j] + self.second[j])

    def cu_first(self, j: int) -> tuple[int, ...]:
        return _cu(self.first[j])

    def cu_second(self, j: int) -> tuple[int, ...]:
        return _cu(self.second[j])

    def first_rows(self, j: int) -> np.ndarray:
        """Rows of ring shard ``j`` that hold first chunks."""
        return _ranges(np.asarray(self.cu_local(j)[:-1]), self.first[j])

    def second_rows(self, j: int) -> np.ndarray:
        return _ranges(np.asarray(self.cu_local(j)[:-1]) + self.first[j], self.second[j])

    def order(self, j: int) -> np.ndarray:
        """Positions, in the plain back-to-back stream of the sequences, of ring shard ``j``'s tokens."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        bounds = chunk_bounds(lengths, self.ring)
        late = 2 * self.ring - 1 - j
        begin = np.stack([starts + bounds[:, j], starts + bounds[:, late]], axis=1).ravel()
        sizes = np.stack([self.first[j], self.second[j]], axis=1).ravel()
        return _ranges(begin, sizes)

    def positions(self, j: int, part: str = "local") -> np.ndarray:
        """Each token's position within its sequence, for ring shard ``j``'s tokens (``local``), its first
        chunks or its second chunks only: what a window or chunk mask reads."""
        bounds = chunk_bounds(np.asarray(self.lengths, dtype=np.int64), self.ring)
        late = 2 * self.ring - 1 - j
        if part == "first":
            return _ranges(bounds[:, j], self.first[j])
        if part == "second":
            return _ranges(bounds[:, late], self.second[j])
        begin = np.stack([bounds[:, j], bounds[:, late]], axis=1).ravel()
        return _ranges(begin, np.stack([self.first[j], self.second[j]], axis=1).ravel())

    def reach(self, i: int, j: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Per sequence present on both sides of ring rank ``i``'s block against ring rank ``j``'s K/V: the
        lowest query position and the highest key position (a bound on each: enough to prove a window or
        chunk excludes the whole block). None for the diagonal block (never excluded)."""
        if i == j:
            return None
        bounds = chunk_bounds(np.asarray(self.lengths, dtype=np.int64), self.ring)
        late_i, late_j = 2 * self.ring - 1 - i, 2 * self.ring - 1 - j
        if j < i:   # all of i's queries against j's first chunks
            valid = (self.first[i] + self.second[i] > 0) & (self.first[j] > 0)
            min_q, max_k = bounds[:, i], bounds[:, j + 1] - 1
        else:       # i's second chunks against all of j's tokens
            valid = (self.second[i] > 0) & (self.first[j] + self.second[j] > 0)
            min_q, max_k = bounds[:, late_i], bounds[:, late_j + 1] - 1
        return min_q[valid], max_k[valid]

    def stream_order(self) -> np.ndarray:
        """For each position of the group stream, the plain-stream token it holds (-1: padding)."""
        out = np.full(self.ring * self.shard_tokens, -1, dtype=np.int64)
        for j in range(self.ring):
            rows = self.order(j)
            out[j * self.shard_tokens: j * self.shard_tokens + rows.size] = rows
        return out


def zigzag_layout(lengths: Sequence[int], ulysses: int, ring: int) -> ZigzagLayout:
    """The layout of sequences of ``lengths`` on a ``ulysses x ring`` group."""
    if ulysses < 1 or ring < 1:
        raise PlanError(f"ulysses and ring degrees must be >= 1, got {ulysses} x {ring}")
    lens = np.asarray([int(n) for n in lengths], dtype=np.int64)
    if lens.size == 0 or lens.min() < 1:
        raise PlanError(f"a ring group needs sequences of at least one token, got lengths {list(lengths)}")
    bounds = chunk_bounds(lens, ring)
    sizes = np.diff(bounds, axis=1)                                     # [n, 2*ring]
    first = tuple(sizes[:, j].copy() for j in range(ring))
    second = tuple(sizes[:, 2 * ring - 1 - j].copy() for j in range(ring))
    longest = max(int(f.sum() + s.sum()) for f, s in zip(first, second))
    shard = max(1, -(-longest // ulysses)) * ulysses
    return ZigzagLayout(lengths=tuple(int(n) for n in lens), ulysses=ulysses, ring=ring, shard_tokens=shard,
                        first=first, second=second)


@dataclass(frozen=True)
class ZigzagGroup:
    """A ring group's stream in zigzag order: input ids, per-sequence positions, next-token labels."""

    layout: ZigzagLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor

    def shard(self, local_rank: int) -> Shard:
        """Group rank ``local_rank``'s contiguous slice (ring index ``local_rank // ulysses``)."""
        lay = self.layout
        if not 0 <= local_rank < lay.degree:
            raise ValueError(f"local rank {local_rank} is outside 0..{lay.degree - 1}")
        n = lay.rank_tokens
        ring_rank, part = divmod(local_rank, lay.ulysses)
        real = max(0, min(n, lay.real_tokens(ring_rank) - part * n))
        rows = slice(local_rank * n, (local_rank + 1) * n)
        return Shard(self.input_ids[rows], self.position_ids[rows], self.labels[rows], real_tokens=real)


def zigzag_pack(sequences: Sequence[torch.Tensor], ulysses: int, ring: int,
                targets: Sequence[torch.Tensor | None] | None = None) -> ZigzagGroup:
    """Lay 1-D token tensors out for a ``ulysses x ring`` group. Labels are ``next_token_labels`` of the plain
    stream (``targets`` as ``flexsp.runtime.shard.pack`` takes them), computed before reordering, so each
    token keeps its label wherever the zigzag puts it."""
    if not sequences:
        raise PlanError("a ring group needs at least one sequence")
    layout = zigzag_layout([int(s.numel()) for s in sequences], ulysses, ring)
    device = sequences[0].device
    ids = torch.cat([s.reshape(-1).to(torch.long) for s in sequences])
    lens = np.asarray(layout.lengths, dtype=np.int64)
    ends = np.cumsum(lens)
    # index arrays are host numpy: moved with to_device (pinned, non_blocking) where the tokens are on a GPU
    positions = to_device(torch.from_numpy(np.arange(ends[-1]) - np.repeat(ends - lens, lens)), device)
    labels = next_token_labels(sequences, targets, to_device(torch.from_numpy(ends - 1), device))
    order = to_device(torch.from_numpy(layout.stream_order()), device)
    pad = order < 0
    take = order.clamp(min=0)
    fill = lambda x, value: torch.where(pad, torch.full_like(x[take], value), x[take])  # noqa: E731
    return ZigzagGroup(layout, fill(ids, PAD_TOKEN), fill(positions, 0), fill(labels, IGNORE_INDEX))


@dataclass(frozen=True)
class RingTensors:
    """What ring rank ``index`` needs on the device: bounds and row indices of every block it attends.

    Built once per micro-batch (two host-to-device copies), shared by every layer.
    """

    index: int
    ring: int
    shard_tokens: int
    cu_local: tuple[torch.Tensor, ...]        # per ring rank j: int32 bounds of shard j
    cu_first: tuple[torch.Tensor, ...]        # per j: int32 bounds of j's first chunks
    first_rows: tuple[torch.Tensor, ...]      # per j: int64 rows of j's first chunks in shard j
    cu_second: torch.Tensor                   # this rank's second-chunk bounds
    second_rows: torch.Tensor                 # this rank's second-chunk rows
    max_local: tuple[int, ...]
    max_first: tuple[int, ...]
    max_second: int
    local_tokens: tuple[int, ...]             # host counts: a block with no tokens is skipped
    first_tokens: tuple[int, ...]
    second_tokens: int
    host_local: tuple[tuple[int, ...], ...] = ()   # the bounds above as host ints: the per-sequence kernels
    host_first: tuple[tuple[int, ...], ...] = ()   # (CPU, or fp32 on CUDA) read these, never the device copies
    host_second: tuple[int, ...] = ()
    pos_local: tuple[torch.Tensor, ...] = ()       # per j: each row's position in its sequence (window/chunk masks)
    pos_first: tuple[torch.Tensor, ...] = ()       # per j: the same for j's first chunks
    pos_second: torch.Tensor | None = None         # this rank's second chunks
    reach: tuple = ()                              # per j: ``ZigzagLayout.reach(index, j)`` (host; block skipping)
    host_pos_local: tuple = ()                     # the positions above as host numpy arrays (the per-sequence
    host_pos_first: tuple = ()                     # kernel's key bands read these)
    host_pos_second: Any = None

    @classmethod
    def build(cls, layout: ZigzagLayout, index: int, device: torch.device | str) -> "RingTensors":
        r = layout.ring
        bounds = [layout.cu_local(j) for j in range(r)] + [layout.cu_first(j) for j in range(r)] + \
                 [layout.cu_second(index)]
        rows = [layout.first_rows(j) for j in range(r)] + [layout.second_rows(index)]
        pos = [layout.positions(j) for j in range(r)] + [layout.positions(j, "first") for j in range(r)] + \
              [layout.positions(index, "second")]
        cu_flat = host_tensor([b for bs in bounds for b in bs], torch.int32, device)   # pinned, non_blocking
        row_flat = host_tensor(np.concatenate(rows + pos).astype(np.int64).tolist(), torch.int64, device)
        cu_parts = cu_flat.split([len(b) for b in bounds])
        row_parts = row_flat.split([x.size for x in rows + pos])
        pos_parts = row_parts[r + 1:]
        longest = lambda sizes: int(sizes.max()) if sizes.size else 0  # noqa: E731
        return cls(index=index, ring=r, shard_tokens=layout.shard_tokens,
                   cu_local=tuple(cu_parts[:r]), cu_first=tuple(cu_parts[r:2 * r]), first_rows=tuple(row_parts[:r]),
                   cu_second=cu_parts[2 * r], second_rows=row_parts[r],
                   max_local=tuple(longest(layout.first[j] + layout.second[j]) for j in range(r)),
                   max_first=tuple(longest(layout.first[j]) for j in range(r)),
                   max_second=longest(layout.second[index]),
                   local_tokens=tuple(layout.real_tokens(j) for j in range(r)),
                   first_tokens=tuple(int(layout.first[j].sum()) for j in range(r)),
                   second_tokens=int(layout.second[index].sum()),
                   host_local=tuple(tuple(b) for b in bounds[:r]), host_first=tuple(tuple(b) for b in bounds[r:2 * r]),
                   host_second=tuple(bounds[2 * r]), pos_local=tuple(pos_parts[:r]),
                   pos_first=tuple(pos_parts[r:2 * r]), pos_second=pos_parts[2 * r],
                   reach=tuple(layout.reach(index, j) for j in range(r)),
                   host_pos_local=tuple(pos[:r]), host_pos_first=tuple(pos[r:2 * r]), host_pos_second=pos[2 * r])
