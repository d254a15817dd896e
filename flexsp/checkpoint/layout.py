"""Where checkpoints live on disk and how one is committed, found and verified. Torch-free.

A checkpoint is a directory ``step-<9 digits>`` under the run's directory. It is written as
``step-<n>.partial`` and renamed once every file is on disk, so a crash mid-write leaves only a
``.partial`` (ignored, removed by the next save) and the previous checkpoint stays usable.
``flexsp.json`` inside it is the commit record: the step, the world size, the loader state and a
manifest of every other file with its size and CRC-32, and a CRC-32 of itself, so a flipped byte or a
truncated file anywhere is reported with the file's name instead of loading silently wrong weights.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from flexsp.checkpoint.errors import CheckpointError

FORMAT = 1
META = "flexsp.json"
RNG = "rng.pt"
_NAME = re.compile(r"^step-(\d{9})$")
_CHUNK = 1 << 20


def final_name(step: int) -> str:
    return f"step-{step:09d}"


def partial_name(step: int) -> str:
    return final_name(step) + ".partial"


def committed(directory: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints (a ``step-n`` directory holding ``flexsp.json``), newest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and (child / META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


def leftovers(directory: Path) -> list[Path]:
    """``.partial`` directories of saves that never committed (a crash mid-write)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(".partial") and p.is_dir())


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def files_of(checkpoint: Path) -> list[str]:
    """Every file of a checkpoint but the commit record, as sorted relative paths."""
    return sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p.name != META)


def describe(checkpoint: Path, names: Iterable[str]) -> dict[str, list[int]]:
    """``{name: [size, crc32]}`` of the given files (each rank describes a share of them)."""
    return {name: [(checkpoint / name).stat().st_size, crc32(checkpoint / name)] for name in names}


def _self_crc(record: dict[str, Any]) -> int:
    body = {k: v for k, v in record.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


@dataclass(frozen=True)
class Record:
    """The commit record of one checkpoint (``flexsp.json``)."""

    step: int
    world_size: int
    files: dict[str, list[int]]          # name -> [size, crc32]
    loader: dict[str, Any] | None
    skipped: list[int] | None            # [count, crc32] of the sequences the epoch leaves out as too long
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        record = {"format": FORMAT, "step": self.step, "world_size": self.world_size, "files": self.files,
                  "loader": self.loader, "skipped": self.skipped, "extra": self.extra}
        record["crc32"] = _self_crc(record)
        return record


def write_record(checkpoint: Path, record: Record) -> None:
    path = checkpoint / META
    tmp = checkpoint / (META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record.to_dict(), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(checkpoint: Path) -> Record:
    """Parse and check ``flexsp.json``; ``CheckpointError`` names the file and what is wrong with it."""
    path = checkpoint / META
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint record ({exc.strerror or exc})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the checkpoint record is corrupt") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {data.get('format')!r} is not the supported {FORMAT}")
    if not isinstance(data.get("crc32"), int) or data["crc32"] != _self_crc(data):
        raise CheckpointError(f"{path}: the record's CRC-32 does not match its contents; the file was modified "
                              f"or corrupted")
    try:
        record = Record(step=_int(data, "step"), world_size=_int(data, "world_size", 1), files=_files(data["files"]),
                        loader=data["loader"], skipped=_pair(data["skipped"]),
                        extra=dict(data["extra"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint record ({type(exc).__name__}: {exc})") from None
    if record.loader is not None and not isinstance(record.loader, dict):
        raise CheckpointError(f"{path}: 'loader' must be an object or null, got {type(record.loader).__name__}")
    return record


def _int(data: dict, key: str, minimum: int = 0) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _pair(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                             for v in value):
        raise ValueError(f"'skipped' must be [count, crc32] or null, got {value!r}")
    return value


def _files(files: Any) -> dict[str, list[int]]:
    if not isinstance(files, dict) or not files:
        raise ValueError("'files' must be a non-empty object of name -> [size, crc32]")
    for name, entry in files.items():
        if (not isinstance(entry, list) or len(entry) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                  for v in entry)):
            raise ValueError(f"'files'[{name!r}] must be [size, crc32], got {entry!r}")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"'files' names {name!r}, which is outside the checkpoint")
    return files


def verify(checkpoint: Path, record: Record, names: Sequence[str], *, checksums: bool = True) -> None:
    """Check the given files against the record (size always, CRC-32 if ``checksums``)."""
    for name in names:
        size, crc = record.files[name]
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {META} but missing; the checkpoint is incomplete")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: {actual} bytes but {size} were written (truncated or overwritten)")
        if checksums and crc32(path) != crc:
            raise CheckpointError(f"{path}: CRC-32 mismatch; the file is corrupt")


def commit(partial: Path, final: Path) -> None:
    """Make a fully written ``partial`` directory the checkpoint ``final`` (one atomic rename)."""
    _fsync_dir(partial)
    if final.exists():   # an older save of the same step (a re-run after a restore): replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync_dir(final.parent)


def prune(directory: Path, keep: int) -> None:
    """Drop all but the newest ``keep`` committed checkpoints, and stale ``.partial`` directories."""
    for _, path in committed(directory)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in leftovers(directory):
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
