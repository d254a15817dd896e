"""Sizes as people write them: ``393216``, ``384K`` (x1024), ``2M`` (x1024^2), ``1G`` (x1024^3).

The one parser behind every command-line size (``flexsp --context``, ``flexsp profile --lengths``):
exact (``1.5M`` is 1,572,864; fractions such as ``1.3`` or ``0.1K`` are refused, never truncated) and
usable directly as an argparse ``type`` (it raises ``SizeError``, an ``ArgumentTypeError``).
"""
from __future__ import annotations

import re
from fractions import Fraction

from .errors import SizeError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")
_SCALE = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
MAX_SIZE = 2 ** 62


def parse_size(text: str, *, what: str = "count", minimum: int = 1) -> int:
    """``text`` as a whole number ``>= minimum``; ``what`` names the quantity in the error."""
    match = _SIZE.match(str(text))
    if not match:
        raise SizeError(f"expected a {what} like 4096, 384K or 2M, got {text!r}")
    value = Fraction(match.group(1)) * _SCALE[match.group(2).lower()]
    if value.denominator != 1 or not minimum <= value <= MAX_SIZE:
        raise SizeError(f"expected a whole {what} >= {minimum} (like 4096, 384K or 1.5M), got {text!r}")
    return int(value)


def parse_sizes(text: str, *, what: str = "count") -> list[int]:
    """A comma list of sizes (``256,1K,4K``), at least one."""
    parts = [t for t in str(text).split(",") if t.strip()]
    if not parts:
        raise SizeError(f"expected a comma list of {what}s like 256,1K,4K, got {text!r}")
    return [parse_size(t, what=what) for t in parts]


def parse_tokens(text: str) -> int:
    """A token count (``flexsp --context``)."""
    return parse_size(text, what="token count")
