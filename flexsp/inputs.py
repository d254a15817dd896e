"""Checked conversions of values a user's script, config file or command line hands to FlexSP.

Each helper turns one value into the type the planner computes with, or raises the caller's error
class (a ``FlexSPError``) with a message naming the value and what would be valid. Strings are never
read as numbers here (a JSON ``"5e9"`` where a number belongs is a typo, not a value), except by
the size parsers: ``393216``, ``384K`` (x1024), ``2M`` (x1024^2), ``1G`` (x1024^3), exact (``1.5M`` is
1,572,864; ``1.3`` or ``0.1K`` are refused, never truncated) and usable as an argparse ``type``
(they raise ``SizeError``, an ``ArgumentTypeError``).

Every file FlexSP reads has a documented cap, checked before the memory is spent (``limit``): JSON
documents (plans, cost models, bandwidth tables; ``read_json``) at most ``FLEXSP_MAX_JSON_BYTES``
bytes (default 64 MiB) and ``MAX_JSON_DEPTH`` levels; lengths files at most ``FLEXSP_MAX_SEQUENCES``
sequences (default 10^7) and, as text (gzip decompressed), ``FLEXSP_MAX_TEXT_BYTES`` bytes (default
2 GiB); plans at most ``FLEXSP_MAX_GROUPS`` groups (default 10^6); ``--gpus`` at most ``FLEXSP_MAX_GPUS``
(default 2^20); command-line counts such as ``--batch-size`` at most ``FLEXSP_MAX_SEQUENCES``. Raise a cap with
the environment variable or the CLI's ``--max-input`` flag (``flexsp --max-input NAME=VALUE``).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from flexsp.errors import FlexSPError, SizeError

T = TypeVar("T")

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


_DECIMAL = re.compile(r"0|[1-9][0-9]*")   # a whole number as JSON writes a key: no sign, space or leading 0


def integer_keys(table: Mapping[Any, T], what: str, error: type[FlexSPError], name: str) -> dict[int, T]:
    """``table`` with each key as the integer it names: an int (not a bool) or its decimal string as JSON
    writes keys (``"8"``). ``"08"``, ``" 8"``, ``"+8"`` or ``"٨"`` are refused: read as 8 they would let two
    keys name one number and the later silently win. So are two keys naming one number (``8`` and ``"8"``)."""
    out: dict[int, T] = {}
    for key, value in table.items():
        if isinstance(key, str) and _DECIMAL.fullmatch(key):
            if len(key) > 40:
                raise error(f"{what} key {_short_repr(key)} is too large for a {name}")
            whole = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):
            whole = int(key)
        else:
            raise error(f"{what} keys must be {name}s, got {_short_repr(key)} (write a key in plain decimal "
                        f"digits, like \"8\")")
        if whole in out:
            raise error(f"{what} names {name} {whole} twice; which value counts would be a guess")
        out[whole] = value
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


# --- caps on what a file may make FlexSP allocate -------------------------------------------------
LIMITS = {   # name -> (environment variable, default, what it bounds)
    "json_bytes": ("FLEXSP_MAX_JSON_BYTES", 64 << 20, "bytes of a JSON file (plan, cost model, bandwidth table)"),
    "sequences": ("FLEXSP_MAX_SEQUENCES", 10 ** 7, "sequences in a lengths file or a batch"),
    "text_bytes": ("FLEXSP_MAX_TEXT_BYTES", 2 << 30, "bytes of a lengths text file (after gzip)"),
    "groups": ("FLEXSP_MAX_GROUPS", 10 ** 6, "groups of a plan"),
    "gpus": ("FLEXSP_MAX_GPUS", 1 << 20, "GPUs of a cluster given on the command line"),
}
MAX_JSON_DEPTH = 64      # FlexSP's documents nest 5 deep; a deeper one is not ours


def limit(name: str) -> int:
    """The cap ``name`` of ``LIMITS``: its environment variable if set (a size like 4G), else the default."""
    variable, default, _ = LIMITS[name]
    text = os.environ.get(variable)
    if not text:
        return default
    try:
        return parse_size(text, what=variable)
    except SizeError as exc:
        raise FlexSPError(f"${variable}: {exc}") from None


def set_limit(assignment: str) -> None:
    """``NAME=VALUE`` from the CLI's ``--max-input``: raise (or lower) one cap for this process."""
    name, _, value = str(assignment).partition("=")
    if name not in LIMITS or not value:
        raise FlexSPError(f"--max-input expects NAME=VALUE with NAME one of {', '.join(LIMITS)}, got {assignment!r}")
    os.environ[LIMITS[name][0]] = str(parse_size(value, what=name))


def raise_hint(name: str) -> str:
    """How a user raises the cap ``name``: every over-cap message ends with it."""
    return f"raise it with --max-input {name}=N or ${LIMITS[name][0]}"


def over_cap(what: str, value: int, name: str, unit: str) -> str:
    """The message for a count given on the command line or in a file above the cap ``name``: what it is, the
    cap, and how to raise it."""
    return f"{what} {value} is over the cap of {limit(name)} {unit}; {raise_hint(name)}"


def too_large(what: str, size: int, name: str) -> str:
    return f"{what} has {size} {name.split('_')[-1]}, over the cap of {limit(name)}; {raise_hint(name)}"


def read_json(path: str | Path, what: str, error: type[FlexSPError]) -> Any:
    """Parse a JSON file: the one reader of every JSON FlexSP reads. Every way it can fail (missing,
    unreadable, larger than the ``json_bytes`` cap, not UTF-8, malformed, nested deeper than
    ``MAX_JSON_DEPTH``, numbers too long, a key twice in one object) is ``error`` naming the file."""
    path = Path(path)
    try:
        if not path.is_file():
            raise error(f"cannot read {what} {path}: no such file" if not path.exists() else
                        f"cannot read {what} {path}: not a regular file")
        size = path.stat().st_size
        if size > limit("json_bytes"):
            raise error(too_large(f"{what} {path}", size, "json_bytes"))
        with open(path, "rb") as f:
            raw = f.read(limit("json_bytes") + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > limit("json_bytes"):   # grew while we looked, or a device file
        raise error(too_large(f"{what} {path}", len(raw), "json_bytes"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start}); expected a JSON file") from None
    return parse_json(text, f"{what} {path}", error)


def load_json(path: str | Path, what: str, error: type[FlexSPError], parse: Callable[[Any], T]) -> T:
    """``parse`` of a JSON file read by ``read_json``; an ``error`` from ``parse`` is prefixed with the path."""
    data = read_json(path, what, error)
    try:
        return parse(data)
    except error as exc:
        raise error(f"{path}: {exc}") from None


def write_text(path: str | Path, text: str, what: str, error: type[FlexSPError]) -> None:
    """Write ``text`` and a newline to ``path``; an OS failure is ``error`` naming the file."""
    try:
        Path(path).write_text(text + "\n")
    except OSError as exc:
        raise error(f"cannot write {what} {path}: {exc.strerror or exc}") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?')   # possessive, closing quote optional: linear time


def json_depth(text: str) -> int:
    """How deeply ``text``'s arrays and objects nest (brackets inside strings do not count), in C speed."""
    skeleton = _JSON_STRING.sub("", text).encode("utf-8", "replace")
    codes = np.frombuffer(skeleton, dtype=np.uint8)
    deepest = level = 0
    for start in range(0, codes.size, 1 << 20):     # chunks: a few MiB of scratch at any input size
        chunk = codes[start:start + (1 << 20)]
        steps = ((chunk == 91) | (chunk == 123)).astype(np.int32) - ((chunk == 93) | (chunk == 125))
        running = np.cumsum(steps, dtype=np.int64) + level
        deepest, level = max(deepest, int(running.max())), int(running[-1])
    return deepest


class DuplicateKey(ValueError):
    pass


def distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when a key comes twice: ``json`` would keep the later value silently."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return out


def parse_json(text: str, what: str, error: type[FlexSPError]) -> Any:
    if not isinstance(text, str):
        raise error(f"{what} must be JSON text (str), got {type(text).__name__}")
    if len(text) > limit("json_bytes"):
        raise error(too_large(what, len(text), "json_bytes"))
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(f"{what} is nested too deeply ({depth} levels; a FlexSP JSON document has at most "
                    f"{MAX_JSON_DEPTH})")
    try:
        return json.loads(text, object_pairs_hook=distinct_keys)
    except DuplicateKey as exc:
        raise error(f"{what} has the key {_short_repr(exc.args[0])} twice in one object; which value counts "
                    f"would be a guess") from None
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
