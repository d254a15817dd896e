"""Dirty device memory on purpose, for checks of the padding contract: rows a kernel never writes hold
whatever the allocator hands back, which is often zeros from a fresh block - so a check that reads them
passes by luck. ``poison_allocator`` allocates a large NaN block and frees it into torch's caching
allocator, so the next allocations of the check reuse NaN-filled memory and an unwritten row shows
as NaN every time."""
from __future__ import annotations

import torch

POISON_FRACTION = 0.25      # of the device's free memory (at most POISON_BYTES)
POISON_BYTES = 8 * 2**30


def poison_allocator(device: torch.device, nbytes: int | None = None) -> int:
    """Fill and free ``nbytes`` (default: a quarter of the free memory, at most 8 GiB) on ``device``; returns
    the bytes poisoned (0 off CUDA, where there is no caching allocator to poison)."""
    if device.type != "cuda":
        return 0
    if nbytes is None:
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = int(min(POISON_BYTES, POISON_FRACTION * free))
    # blocks of 512 MiB: the caching allocator splits and reuses these for the check's tensors
    block = 512 * 2**20
    kept = [torch.full((min(block, nbytes - start) // 4,), float("nan"), dtype=torch.float32, device=device)
            for start in range(0, nbytes, block)]
    done = sum(t.numel() * 4 for t in kept)
    del kept   # freed into the cache, NaN-filled (torch does not clear freed blocks)
    return done
