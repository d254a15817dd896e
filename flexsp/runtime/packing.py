"""Deprecated: renamed ``flexsp.runtime.token_packing`` so that it is not confused with the solver's bin
packing (``solver/packing.py``). ``flexsp.runtime.pack`` and ``PackedGroup`` are unchanged."""
from __future__ import annotations

import warnings

from .token_packing import IGNORE_INDEX, PAD_TOKEN, PackedGroup, Shard, loss_tokens, pack

warnings.warn("flexsp.runtime.packing is deprecated: import from flexsp.runtime (or flexsp.runtime.token_packing)",
              DeprecationWarning, stacklevel=2)

__all__ = ["IGNORE_INDEX", "PAD_TOKEN", "PackedGroup", "Shard", "loss_tokens", "pack"]
