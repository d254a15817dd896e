"""Where checkpoints live on disk and how one is committed, found and verified. Torch-free.

A checkpoint is a directory ``step-<9 digits>`` under the run's directory. It is written as
``step-<n>.partial`` and renamed once every file is on disk, so a crash mid-write leaves only a
``.partial`` (ignored, removed by the next save) and the previous checkpoint stays usable.
``flexsp.json`` inside it is the commit record: the step, the world size, the loader state and a
manifest of every other file with its size and SHA-256, signed with an HMAC-SHA256 under a key kept
outside the directory (``trust``). A flipped byte, a truncated file, an added file or a symlink anywhere
is reported with the file's name, and a record re-computed without the key is refused, before any
reader that could unpickle touches the files.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from flexsp.checkpoint import trust
from flexsp.checkpoint.errors import CheckpointError
from flexsp.inputs import parse_json

FORMAT = 2
MAX_RECORD_BYTES = 64 << 20   # the loader state is the only part that grows; far below this
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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def files_of(checkpoint: Path) -> list[str]:
    """Every entry of a checkpoint but the commit record, as sorted relative paths. A symlink (to a file,
    a directory or nowhere) or anything that is not a plain file or directory is refused: the restore
    must read only bytes that live inside the checkpoint and are covered by its manifest."""
    if checkpoint.is_symlink():
        raise CheckpointError(f"{checkpoint}: the checkpoint directory is a symlink; refused")
    names = []
    for path in checkpoint.rglob("*"):
        if path.is_symlink():
            raise CheckpointError(f"{path}: a symlink inside the checkpoint; refused")
        if path.is_file():
            if path.name != META:
                names.append(str(path.relative_to(checkpoint)))
        elif not path.is_dir():
            raise CheckpointError(f"{path}: not a regular file; refused")
    return sorted(names)


def describe(checkpoint: Path, names: Iterable[str]) -> dict[str, list]:
    """``{name: [size, sha256]}`` of the given files (each rank describes a share of them)."""
    return {name: [(checkpoint / name).stat().st_size, sha256(checkpoint / name)] for name in names}


def _body(record: dict[str, Any]) -> bytes:
    """The signed bytes: the whole record but its signature, canonical JSON."""
    return json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True).encode()


@dataclass(frozen=True)
class Record:
    """The commit record of one checkpoint (``flexsp.json``)."""

    step: int
    world_size: int
    files: dict[str, list]               # name -> [size, sha256 hex]
    loader: dict[str, Any] | None
    skipped: list[int] | None            # [count, crc32] of the sequences the epoch leaves out as too long
    extra: dict[str, Any]

    def to_dict(self, key: bytes) -> dict[str, Any]:
        record = {"format": FORMAT, "step": self.step, "world_size": self.world_size, "files": self.files,
                  "loader": self.loader, "skipped": self.skipped, "extra": self.extra}
        record["hmac"] = trust.sign(key, _body(record))
        return record


def write_record(checkpoint: Path, record: Record, key: bytes) -> None:
    path = checkpoint / META
    tmp = checkpoint / (META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record.to_dict(key), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(checkpoint: Path, key: bytes | None, *, key_source: str = "this job's key") -> Record:
    """Parse ``flexsp.json`` and check its signature; ``CheckpointError`` names the file and what is wrong.

    ``key=None`` is the explicit trust override: the signature is not checked (the manifest still is)."""
    path = checkpoint / META
    try:
        if checkpoint.is_symlink() or path.is_symlink():
            raise CheckpointError(f"{path}: the checkpoint or its record is a symlink; refused")
        if path.exists() and not path.is_file():       # a FIFO would block the read forever
            raise CheckpointError(f"{path}: the checkpoint record is not a regular file; refused")
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, over the {MAX_RECORD_BYTES} a record may have")
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint record ({exc.strerror or exc})") from None
    if len(raw) > MAX_RECORD_BYTES:                    # grew while we looked
        raise CheckpointError(f"{path}: over the {MAX_RECORD_BYTES} bytes a record may have")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 ({exc}); the checkpoint record is corrupt") from None
    # the bounded parser: nesting and number length too (a RecursionError or ValueError here would escape
    # restore()'s fallback to an older checkpoint, which catches CheckpointError)
    data = parse_json(text, f"{path}: the checkpoint record", CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {data.get('format')!r} is not the supported {FORMAT}")
    if key is not None and not trust.signed_by(key, _body(data), data.get("hmac")):
        raise CheckpointError(f"{path}: the record is not signed with {key_source} (modified, corrupted, or "
                              f"written by someone else); only restore a checkpoint you trust, and then pass "
                              f"trust_unsigned=True")
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


_HEX = re.compile(r"^[0-9a-f]{64}$")


def _files(files: Any) -> dict[str, list]:
    if not isinstance(files, dict) or not files:
        raise ValueError("'files' must be a non-empty object of name -> [size, sha256]")
    for name, entry in files.items():
        if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], int) or entry[0] < 0
                or not isinstance(entry[1], str) or not _HEX.match(entry[1])):
            raise ValueError(f"'files'[{name!r}] must be [size, sha256 hex], got {entry!r}")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"'files' names {name!r}, which is outside the checkpoint")
    return files


def verify(checkpoint: Path, record: Record, names: Sequence[str]) -> None:
    """Check the checkpoint's entries against the record: no file missing or added, no symlink, and the
    given share of files with their size and SHA-256 (the ranks hash a share each)."""
    present = files_of(checkpoint)
    added = sorted(set(present) - set(record.files))
    if added:
        raise CheckpointError(f"{checkpoint / added[0]}: not listed in {META}; the checkpoint was modified")
    for name in names:
        size, digest = record.files[name]
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {META} but missing; the checkpoint is incomplete")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: {actual} bytes but {size} were written (truncated or overwritten)")
        if sha256(path) != digest:
            raise CheckpointError(f"{path}: SHA-256 mismatch; the file is corrupt or was modified")


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
