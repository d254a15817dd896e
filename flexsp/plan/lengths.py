"""Sequence-length distributions: validate, load, sample and preprocess batches of lengths.

Everything the planner sees as "a batch" passes through :func:`as_lengths`, the one place that
decides what a valid length is (a positive integer token count). Distributions come from a file of
lengths, the bundled Wikipedia sample, or a documented parametric *approximation* of the GitHub and
CommonCrawl corpora used in the FlexSP paper (arXiv 2412.01523), whose real length files are not
public here.
"""
from __future__ import annotations

import functools
import gzip
import os
import re
import types
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Union

import numpy as np

from flexsp.errors import ContextError, LengthsError
from flexsp.inputs import limit, too_large

PathLike = Union[str, "os.PathLike[str]"]

_INT64_MAX = np.iinfo(np.int64).max
_SHORT = 8192  # describe() reports the share of sequences at most this long


# --------------------------------------------------------------------------------------- validation

def _bad(name: str, index: int, value: Any, reason: str) -> LengthsError:
    return LengthsError(f"{name}[{index}] = {value!r} is not a valid sequence length: {reason}")


def _is_number_type(t: type) -> bool:
    return issubclass(t, (int, float, np.integer, np.floating)) and not issubclass(t, (bool, np.bool_))


def _scalar_problem(value: Any) -> str | None:
    """Why one Python/numpy scalar is not a length, or None. Used only on slow, rare paths."""
    if isinstance(value, (bool, np.bool_)):
        return "a bool is not a token count"
    if not _is_number_type(type(value)):
        return f"expected a positive integer, got {type(value).__name__}"
    if isinstance(value, (float, np.floating)):
        if value != value or value in (float("inf"), float("-inf")):
            return "not a finite number"
        if not float(value).is_integer():
            return "not a whole number of tokens"
    if value <= 0:
        return "lengths must be >= 1"
    if value > _INT64_MAX:
        return f"too large (at most {_INT64_MAX})"
    return None


def _first_problem_in_array(arr: np.ndarray) -> tuple[int, str] | None:
    """Vectorised scan of a 1-D array: (index, reason) of the first invalid entry, or None."""
    kind = arr.dtype.kind
    if kind == "b":
        return 0, "a bool is not a token count"
    if kind in "iu":
        bad = arr <= 0
        if kind == "u":
            bad |= arr > _INT64_MAX
    elif kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr <= 0) | (arr != np.floor(arr)) | (arr >= 2.0 ** 63)
    elif kind == "O":
        for i, value in enumerate(arr):
            reason = _scalar_problem(value)
            if reason is not None:
                return i, reason
        return None
    else:
        return 0, f"expected integers, got an array of dtype {arr.dtype}"
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    return i, _scalar_problem(arr[i].item()) or "not a positive integer"


def as_lengths(values: Iterable[Any] | np.ndarray, *, name: str = "lengths") -> np.ndarray:
    """Validate a batch of sequence lengths and return it as a fresh 1-D int64 array.

    Accepts lists, tuples, other iterables and numpy arrays (integer dtype, or float dtype holding
    whole numbers). Rejects an empty batch and any value that is not a positive integer (0,
    negatives, 1.5, NaN, bools, strings) with a :class:`LengthsError` naming the first bad value and
    its index. Vectorised, so a 131,072-length batch costs milliseconds.
    """
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
            raise LengthsError(f"{name} must be a sequence of positive integers, "
                               f"got {type(values).__name__}")
        items = values if isinstance(values, (list, tuple)) else list(values)
        # One cheap pass over the Python types: catches bools (numpy would silently turn
        # [True, 2] into [1, 2]), strings, None, nested lists... before numpy coerces them.
        if not all(_is_number_type(t) for t in set(map(type, items))):
            for i, value in enumerate(items):
                if not _is_number_type(type(value)):
                    shown = value.item() if isinstance(value, np.generic) else value
                    raise _bad(name, i, shown, _scalar_problem(value) or "not a number")
        try:
            arr = np.asarray(items)
        except (OverflowError, ValueError):  # ints beyond uint64: keep them as Python objects
            arr = np.asarray(items, dtype=object)
    if arr.ndim != 1:
        raise LengthsError(f"{name} must be one-dimensional, got an array of shape {arr.shape}")
    if arr.size == 0:
        raise LengthsError(f"{name} is empty: a batch needs at least one sequence")
    problem = _first_problem_in_array(arr)
    if problem is not None:
        i, reason = problem
        value = arr[i].item() if isinstance(arr[i], np.generic) else arr[i]
        raise _bad(name, i, value, reason)
    return np.array(arr, dtype=np.int64)  # always a copy: callers may mutate it freely


# ------------------------------------------------------------------------------------------ loading

_FORMATS = "a .npy array or a text file (.txt or .txt.gz) with one integer per line"


_CHUNK = 1 << 20   # bytes of text parsed at a time: the parser's scratch, whatever the file's size
_MAX_LINE = 1 << 16  # bytes of one line: a length has at most 19 digits; a longer line is no length file's
_LENGTH_BYTES = b"0123456789 \t\r\n"   # all a lengths text holds: ASCII digits, spaces, tabs, line ends
_INNER_SPACE = re.compile(rb"[0-9][ \t]+[0-9]")   # two numbers on one line ("1 2")


def _text_chunks(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(first line number, text)`` of a text or gzip file, about 1 MiB of whole lines at a time.

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (``bytes.splitlines``). A line longer than ``_MAX_LINE`` is
    refused, so a file without line ends costs linear time, not a rebuilt, growing line per chunk. The
    decompressed size is capped (``flexsp.inputs.limit("text_bytes")``) as it streams, so a gzip bomb
    stops at the cap instead of filling memory."""
    cap = limit("text_bytes")
    seen, line_no, tail = 0, 1, b""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            while True:
                block = f.read(_CHUNK)
                seen += len(block)
                if seen > cap:
                    raise LengthsError(f"{path}: " + too_large("the lengths text", seen, "text_bytes")
                                       .replace("has ", "has at least ", 1))
                if not block:
                    break
                if seen == len(block) and block.startswith(b"\xef\xbb\xbf"):
                    block = block[3:]   # a byte-order mark (Windows editors) is not data
                data = tail + block     # tail < _MAX_LINE bytes: linear in the file
                # cut after the last line end; never between the \r and \n of one
                cut = max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1
                tail, data = data[cut:], data[:cut]
                if data:
                    yield line_no, data
                    line_no += data.count(b"\n")
                    if b"\r" in data:      # lone \r line ends (a \r\n counted once)
                        line_no += data.count(b"\r") - data.count(b"\r\n")
                if len(tail) > _MAX_LINE:
                    raise LengthsError(f"{path}, line {line_no}: over {_MAX_LINE} bytes long, too long for a "
                                       f"sequence length; expected {_FORMATS}")
            if tail:
                yield line_no, tail
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise LengthsError(f"{path}: cannot read lengths ({e}); expected {_FORMATS}") from None


def _parse_lines(path: Path, first: int, data: bytes) -> np.ndarray:
    """The lengths in ``data`` (whole lines from line ``first``): each line one number in ASCII digits,
    with spaces or tabs around it, or blank. Anything else (``+5``, ``1_000``, ``1.5``, other scripts'
    digits, two numbers) is refused naming its line, never read as some other number."""
    if not data.translate(None, _LENGTH_BYTES) and not ((b" " in data or b"\t" in data)
                                                         and _INNER_SPACE.search(data)):
        try:  # fast path: blank lines skipped by split(), every other line one ASCII number
            values = np.array(data.split(), dtype=np.int64)
        except (ValueError, OverflowError):   # above int64, or past int()'s digit limit
            values = None
        if values is not None and not (values <= 0).any():
            return values
    # Slow path, taken for a bad line: find the first one and name it.
    parsed: list[int] = []
    for number, raw in enumerate(data.splitlines(), start=first):
        line = raw.strip(b" \t")
        if not line:
            continue
        digits = line[1:] if line.startswith(b"-") else line   # a negative number is named as one
        if not digits.isdigit():        # bytes: ASCII digits only
            shown = line[:40].decode("utf-8", "replace")
            raise LengthsError(f"{path}, line {number}: {shown!r} is not an integer in ASCII digits 0-9; "
                               f"expected one sequence length per line")
        if len(digits.lstrip(b"0")) > 19:
            raise LengthsError(f"{path}, line {number}: a {len(digits)}-digit number is not a valid sequence "
                               f"length: lengths must be between 1 and {_INT64_MAX}")
        value = int(line)
        if not 0 < value <= _INT64_MAX:
            raise LengthsError(f"{path}, line {number}: {value} is not a valid sequence length: "
                               f"lengths must be between 1 and {_INT64_MAX}")
        parsed.append(value)
    return np.array(parsed, dtype=np.int64)


def _load_text(path: Path) -> np.ndarray:
    """Streamed: memory is about the result (8 bytes a length) plus one chunk's scratch."""
    cap = limit("sequences")
    parts, count = [], 0
    for first, data in _text_chunks(path):
        values = _parse_lines(path, first, data)
        count += values.size
        if count > cap:
            raise LengthsError(f"{path}: " + too_large("the lengths file", count, "sequences")
                               .replace("has ", "has at least ", 1))
        parts.append(values)
    if not count:
        raise LengthsError(f"{path}: the file holds no lengths")
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _load_npy(path: Path) -> np.ndarray:
    """A ``.npy`` file, its header checked against the file before anything is allocated: 1-D, an
    integer dtype, no pickles, and a shape that matches the bytes present exactly."""
    fmt = np.lib.format
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy version {version}")
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            header = read(f, max_header_size=10000)
            offset = f.tell()
    except Exception as e:   # numpy's header parser raises ValueError, SyntaxError, TokenError, ...
        raise LengthsError(f"{path}: not a readable .npy array ({type(e).__name__}: {e})") from None
    shape, fortran, dtype = header
    if dtype.hasobject or dtype.kind not in "iu":
        raise LengthsError(f"{path}: dtype {dtype} holds no integer lengths; expected a 1-D integer array")
    if len(shape) != 1:
        raise LengthsError(f"{path}: shape {shape}; expected a 1-D array of lengths")
    if shape[0] > limit("sequences"):
        raise LengthsError(f"{path}: " + too_large("the array", shape[0], "sequences"))
    if shape[0] * dtype.itemsize != size - offset:
        raise LengthsError(f"{path}: the header says {shape[0]} lengths ({shape[0] * dtype.itemsize} bytes) but "
                           f"{size - offset} bytes follow it; the file is truncated or its header was edited")
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise LengthsError(f"{path}: not a readable .npy array ({e})") from None
    try:
        return as_lengths(arr, name="lengths")
    except LengthsError as e:
        raise LengthsError(f"{path}: {e}") from None


def load_lengths(path: PathLike) -> np.ndarray:
    """Load and validate lengths from ``.npy``, ``.txt`` or ``.txt.gz`` (one integer per line).

    A line holds one length in ASCII digits (spaces or tabs around it allowed), or nothing: blank lines are
    ignored. Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` and are at most 64 KiB long. A bad line raises
    :class:`LengthsError` naming the file and line.
    Any suffix other than ``.npy``/``.gz`` is read as plain text. Bounded: see ``flexsp.inputs.LIMITS``
    (sequences, decompressed text bytes); text is streamed, a ``.npy`` header checked against the file.
    """
    path = Path(path)
    if not path.is_file():
        raise LengthsError(f"no such lengths file: {path} (expected {_FORMATS})")
    if path.suffix == ".npy":
        return _load_npy(path)
    return _load_text(path)


def locate(path: PathLike, index: int) -> str:
    """Where the ``index``-th length of a lengths file sits, in the file's terms, for error messages:
    ``"big.txt line 7"`` (blank lines counted, as an editor numbers them) or ``"x.npy entry 7"`` (from 0,
    as numpy indexes). Reads the file again, so only error paths call it."""
    path = Path(path)
    if path.suffix == ".npy":
        return f"{path} entry {index}"
    seen = 0
    for first, data in _text_chunks(path):
        for number, line in enumerate(data.splitlines(), start=first):
            if line.strip():
                if seen == index:
                    return f"{path} line {number}"
                seen += 1
    return f"{path} length {index + 1}"


# ------------------------------------------------------------------------------------ distributions

@dataclass(frozen=True, eq=False)
class LengthDistribution:
    """An empirical distribution of sequence lengths (tokens) to draw global batches from.

    ``approximate`` marks synthetic stand-ins for corpora whose real lengths are not available;
    ``source`` says where the numbers come from; ``path``: the file it was loaded from (errors name its
    lines, ``locate``), None for a built-in one. ``lengths`` is stored read-only.
    """

    name: str
    lengths: np.ndarray
    approximate: bool
    source: str
    path: Path | None = None

    def where(self, index: int) -> str:
        """The ``index``-th length in the terms of its source: a file's line, else ``"<name> length i"``."""
        return locate(self.path, index) if self.path is not None else f"{self.name} length {index}"

    def __post_init__(self) -> None:
        lengths = as_lengths(self.lengths, name=f"{self.name} lengths")
        lengths.flags.writeable = False  # shared by every batch drawn from it
        object.__setattr__(self, "lengths", lengths)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def sample_batch(self, batch_size: int, rng_or_seed: int | np.random.Generator) -> np.ndarray:
        """Draw ``batch_size`` lengths with replacement; the same seed gives the same batch."""
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise LengthsError(f"batch_size must be a positive integer, got {batch_size!r}")
        if isinstance(rng_or_seed, np.random.Generator):
            rng = rng_or_seed
        elif isinstance(rng_or_seed, (int, np.integer)) and not isinstance(rng_or_seed, (bool, np.bool_)) \
                and rng_or_seed >= 0:
            rng = np.random.default_rng(int(rng_or_seed))
        else:
            raise LengthsError("rng_or_seed must be a non-negative integer seed or a "
                               f"numpy.random.Generator, got {rng_or_seed!r}")
        return self.lengths[rng.integers(0, self.lengths.size, size=int(batch_size))]

    def describe(self) -> str:
        """One line of summary statistics, flagged when the distribution is an approximation."""
        x = self.lengths
        line = (f"{self.name}: {x.size:,} lengths, median {np.median(x):,.0f}, mean {x.mean():,.0f}, "
                f"max {int(x.max()):,}, {np.mean(x <= _SHORT):.1%} <= {_SHORT}")
        return line + " [APPROXIMATION]" if self.approximate else line


# ---------------------------------------------------------------------------- built-in distributions

@dataclass(frozen=True)
class _LogNormal:
    weight: float  # mixture weight
    median: float  # tokens; exp(mu)
    sigma: float   # std-dev of log(length)


# Approximations of the paper's GitHub and CommonCrawl length distributions. The real files are not
# public; these are two-component log-normal mixtures (a body of ordinary documents plus a tail of
# long ones) chosen to match the few published facts we could verify, plus stated assumptions:
#
# * Mean document size in the Pile (Gao et al. 2020, arXiv 2101.00027, Table 1): GitHub 5.25 KiB,
#   Pile-CC 4.33 KiB. At ~3 bytes/token for code and ~4.3 bytes/token for English web text that is
#   roughly 1.8K and 1.0K tokens. C4.en (a cleaned CommonCrawl; 364.9M documents, 828.6 GB in
#   the HF dataset card) averages ~2.3 KB, i.e. ~500 tokens per page.
# * FlexSP (arXiv 2412.01523, Fig. 1): all three corpora are long-tailed; GitHub has the heaviest
#   tail (more documents beyond 32K/128K than Wikipedia), CommonCrawl is mostly short web pages
#   with a thin tail. We could not retrieve the figure's numbers, so the tail weights are ours:
#   GitHub ~1.3% of documents > 32K and ~0.2% > 128K (about 10x / 50x the bundled Wikipedia
#   sample's 0.13% / 0.005%); CommonCrawl ~0.08% > 32K and ~0.002% > 128K. GitHub's mean (~2.9K) is
#   above the Pile's because the Pile dropped very large files, which long-context training keeps.
# Lengths are rounded up to whole tokens and capped at 2**21 (the Wikipedia sample's max is 1.82M).
_APPROXIMATIONS: Mapping[str, tuple[_LogNormal, ...]] = types.MappingProxyType({
    "github": (_LogNormal(0.93, 550.0, 1.25), _LogNormal(0.07, 8000.0, 1.5)),
    "commoncrawl": (_LogNormal(0.97, 450.0, 0.95), _LogNormal(0.03, 3000.0, 1.2)),
})
_APPROXIMATION_SIZE = 1_000_000
_APPROXIMATION_CAP = 2 ** 21
BUILTIN_DISTRIBUTIONS = ("wikipedia", *_APPROXIMATIONS)

_WIKIPEDIA_SOURCE = ("1,000,000 sampled Wikipedia document lengths (tokens) from the public FlexSP "
                     "reference release (Apache-2.0); see flexsp/lengths_data/ATTRIBUTION.md")


@functools.lru_cache(maxsize=1)
def _wikipedia_lengths() -> np.ndarray:
    """The bundled sample, parsed once per process (read-only, so sharing it is safe)."""
    with resources.as_file(resources.files("flexsp") / "lengths_data" / "wikipedia.txt.gz") as path:
        lengths = load_lengths(path)
    lengths.flags.writeable = False
    return lengths


@functools.lru_cache(maxsize=8)
def _approximate_lengths(name: str, seed: int) -> np.ndarray:
    """Deterministic draw from a named mixture: same (name, seed), same lengths."""
    components = _APPROXIMATIONS[name]
    rng = np.random.default_rng(seed)
    weights = np.array([c.weight for c in components])
    which = rng.choice(len(components), size=_APPROXIMATION_SIZE, p=weights / weights.sum())
    mu = np.log([c.median for c in components])[which]
    sigma = np.array([c.sigma for c in components])[which]
    raw = np.exp(mu + sigma * rng.standard_normal(_APPROXIMATION_SIZE))
    lengths = np.clip(np.ceil(raw), 1, _APPROXIMATION_CAP).astype(np.int64)
    lengths.flags.writeable = False
    return lengths


def _approximation_source(name: str) -> str:
    parts = ", ".join(f"{c.weight:g} x LogNormal(median {c.median:g}, sigma {c.sigma:g})"
                      for c in _APPROXIMATIONS[name])
    return (f"approximation of the {name} corpus used in FlexSP (arXiv 2412.01523), not the real "
            f"corpus: {parts}, see flexsp/plan/lengths.py")


def get_distribution(name_or_path: PathLike, seed: int = 0) -> LengthDistribution:
    """A built-in distribution by name ("wikipedia", "github", "commoncrawl") or one loaded from a file.

    ``seed`` only affects the generated approximations (github, commoncrawl).
    """
    if isinstance(name_or_path, str) and name_or_path.lower() in BUILTIN_DISTRIBUTIONS:
        name = name_or_path.lower()
        if name == "wikipedia":
            return LengthDistribution(name, _wikipedia_lengths(), False, _WIKIPEDIA_SOURCE)
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise LengthsError(f"seed must be a non-negative integer, got {seed!r}")
        return LengthDistribution(name, _approximate_lengths(name, int(seed)), True,
                                  _approximation_source(name))
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise LengthsError(f"expected a distribution name or a file path, got {type(name_or_path).__name__}")
    path = Path(name_or_path)
    if not path.exists() and isinstance(name_or_path, str) and path.suffix == "" and len(path.parts) == 1:
        raise LengthsError(f"unknown length distribution {name_or_path!r}; choose one of "
                           f"{', '.join(BUILTIN_DISTRIBUTIONS)}, or give a path to {_FORMATS}")
    name = path.name.removesuffix(".gz").removesuffix(".txt").removesuffix(".npy")
    return LengthDistribution(name, load_lengths(path), False, f"file {path}", path)


# ------------------------------------------------------------------------------------ preprocessing

def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LengthsError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def preprocess(lengths: Iterable[int] | np.ndarray, context_limit: int, num_gpus: int,
               round_to_multiple: bool = True) -> tuple[np.ndarray, int]:
    """The paper's preprocessing: drop over-long sequences, pad the rest to a multiple of 2 x N.

    Ulysses splits each sequence evenly over the GPUs of its group (at most N), so padding every
    length to a multiple of ``2 * num_gpus`` makes every split exact. A sequence is kept when its
    *padded* length fits ``context_limit``, so every returned length is <= ``context_limit`` (this
    only differs from "length <= context_limit" when the limit is not itself a multiple of 2 x N).
    Returns ``(kept_lengths, dropped_count)`` in the original order; the count is never hidden.
    """
    arr = as_lengths(lengths)
    if not round_to_multiple:
        keep = arr <= _positive_int(context_limit, "context_limit")
        _positive_int(num_gpus, "num_gpus")
        return arr[keep], int(arr.size - keep.sum())
    padded, keep = padded_and_kept(arr, context_limit, num_gpus)
    return padded[keep], int(arr.size - keep.sum())


def padded_and_kept(lengths: np.ndarray, context_limit: int, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """``preprocess``'s two rules, position by position: every length padded up to a multiple of
    ``2 x num_gpus``, and whether it is kept (its padded length fits ``context_limit``)."""
    limit = _positive_int(context_limit, "context_limit")
    multiple = 2 * _positive_int(num_gpus, "num_gpus")
    limit -= limit % multiple  # the longest padded length that still fits
    if limit == 0:
        raise LengthsError(f"context_limit {context_limit} is below 2 x num_gpus = {multiple}: "
                           f"no padded sequence can fit")
    return -(-lengths // multiple) * multiple, lengths <= limit


OVER_CONTEXT = ("error", "truncate")   # what bound_context does with a sequence above the context limit


def bound_context(lengths: Iterable[int] | np.ndarray, context: int, policy: str = "error",
                  where: Callable[[int], str] | None = None) -> tuple[np.ndarray, int]:
    """Hold every length to ``context``. ``policy="error"`` (the default) refuses a longer sequence
    with a ``ContextError`` naming it (``where(i)``, e.g. a file's line, default ``"sequence i"``);
    ``"truncate"`` cuts it to ``context`` tokens (what a loader
    that drops the tail does). Dropping is not offered: plans index sequences by position, so a
    dropped sequence would silently shift every id after it. Returns ``(lengths, cut_count)``."""
    arr = as_lengths(lengths)
    limit = _positive_int(context, "context")
    if policy not in OVER_CONTEXT:
        raise LengthsError(f"over-context policy must be one of {', '.join(OVER_CONTEXT)}; got {policy!r}")
    over = np.flatnonzero(arr > limit)
    if over.size and policy == "error":
        first = int(over[0])
        name = where(first) if where is not None else f"sequence {first}"
        raise ContextError(f"{over.size} sequence(s) longer than the context limit {limit:,} tokens, the first is "
                           f"{name} with {int(arr[first]):,}; raise --context, or cut them with "
                           f"--over-context truncate")
    return np.minimum(arr, limit), int(over.size)
