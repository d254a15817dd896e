"""Checked conversions of values a user's script, config file or command line hands to FlexSP.

Each helper turns one value into the type the planner computes with, or raises the caller's error
class (a ``FlexSPError``) with a message naming the value and what would be valid. Strings are never
read as numbers here (a JSON ``"5e9"`` where a number belongs is a typo, not a value), except by
the size parsers: ``393216``, ``384K`` (x1024), ``2M`` (x1024^2), ``1G`` (x1024^3), exact (``1.5M`` is
1,572,864; ``1.3`` or ``0.1K`` are refused, never truncated) and usable as an argparse ``type``
(they raise ``SizeError``, an ``ArgumentTypeError``).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from flexsp.errors import FlexSPError, SizeError

INT64_MAX = 2**63 - 1


def number(value: Any, what: str, error: type[FlexSPError], *, minimum: float | None = 0.0,
           positive: bool = False) -> float:
    """A finite real number (not a bool, not a string) as a float, ``>= minimum`` (``> 0`` with ``positive``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        raise error(f"{what} = {_short_repr(value)} is too large for a float (at most about 1.8e308)") from None
    if not math.isfinite(out):
        raise error(f"{what} must be finite, got {out}")
    if positive and not out > 0:
        raise error(f"{what} must be > 0, got {out}")
    if minimum is not None and out < minimum:
        raise error(f"{what} must be >= {minimum:g}, got {out}")
    return out


def integer(value: Any, what: str, error: type[FlexSPError], *, minimum: int | None = 1,
            maximum: int | None = INT64_MAX) -> int:
    """An integer (Python or numpy; not a bool, float or string) within ``[minimum, maximum]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise error(f"{what} must be an integer, got {_short_repr(value)}")
    out = int(value)
    if minimum is not None and out < minimum:
        raise error(f"{what} must be >= {minimum}, got {out}")
    if maximum is not None and out > maximum:
        raise error(f"{what} = {_short_repr(out)} is too large (at most {maximum})")
    return out


def power_of_two(value: Any, what: str, error: type[FlexSPError]) -> int:
    out = integer(value, what, error)
    if out & (out - 1):
        raise error(f"{what} must be a power of two (1, 2, 4, ...), got {out}")
    return out


def exact_sum(values: np.ndarray) -> int:
    """Sum of non-negative int64 values as a Python int: int64 arithmetic when it cannot overflow."""
    if values.size == 0:
        return 0
    if int(values.max()) <= INT64_MAX // values.size:
        return int(values.sum())
    return sum(int(v) for v in values)


def read_json(path: str | Path, what: str, error: type[FlexSPError]) -> Any:
    """Parse a JSON file; every way it can fail (missing, unreadable, not UTF-8, malformed, nested
    too deeply, numbers too long) is ``error`` naming the file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start}); expected a JSON file") from None
    return parse_json(text, f"{what} {path}", error)


def parse_json(text: str, what: str, error: type[FlexSPError]) -> Any:
    if not isinstance(text, str):
        raise error(f"{what} must be JSON text (str), got {type(text).__name__}")
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a FlexSP JSON document") from None
    except ValueError as exc:   # JSONDecodeError, and integers beyond Python's digit limit
        raise error(f"{what} is not valid JSON: {exc}") from None


def writable_file(path: str | Path, what: str, error: type[FlexSPError]) -> Path:
    """``path`` can be created or overwritten: its folder exists and is writable, it is not a folder.
    Checked before any long computation so its result is not lost at the end."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise error(f"{what} {path} is a folder; give a file name")
    if not folder.is_dir():
        raise error(f"cannot write {what} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise error(f"cannot write {what} {path}: permission denied")
    return path


def _short_repr(value: Any, limit: int = 40) -> str:
    try:
        text = repr(value)
    except ValueError:          # ints beyond the digit limit cannot even be printed
        return "a number with too many digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# --- sizes as people write them ------------------------------------------------------------------
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
