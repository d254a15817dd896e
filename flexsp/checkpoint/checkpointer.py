"""``Checkpointer``: save and restore a training job's model, optimizer, loader and RNG state.

Model and optimizer go through ``torch.distributed.checkpoint`` (DCP) with the ``state_dict`` helpers
of ``torch.distributed.checkpoint.state_dict``, so FSDP2-sharded (DTensor) and plain replicated states
are both written once, in shards, and read back at the same or another world size (DCP reshards
DTensors; replicated tensors are read whole). The loader's state and a commit record go in
``flexsp.json``; each rank's RNG state in ``rng.pt`` (tensors and plain values, read with
``weights_only=True``). See ``layout`` for the atomic on-disk format and ``trust`` for the signing key:
a restore verifies the signed manifest before any reader touches the files, reads DCP's pickled
``.metadata`` with an allow-list unpickler and DCP's non-tensor items with ``weights_only=True``, so a
checkpoint never runs code.

In a training loop::

    ckpt = Checkpointer("ckpt/", model, optimizer, loader=loader, every=100)
    ckpt.restore()                 # continue from the newest good checkpoint, if any
    for step in loader:
        ...                        # one optimizer step
        if ckpt.step_done():       # saves every 100 steps, and at once after SIGTERM (then returns True)
            break
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import re
import shutil
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flexsp.checkpoint import layout, trust
from flexsp.checkpoint.errors import CheckpointError
from flexsp.runtime.failures import DEFAULT_TIMEOUT, ControlGroup, error_line


class Checkpointer:
    """Checkpoints one job into ``directory`` (a filesystem every rank sees). Build it on every rank.

    ``every``: save after every ``every`` optimizer steps (0: only on a signal or ``save()``).
    ``keep``: committed checkpoints kept (older ones are deleted after each save).
    ``extra``: more state to save, ``{name: obj}`` with ``state_dict()``/``load_state_dict()``, identical on
    every rank (a global counter, a scheduler). ``signals``: signals that ask for a checkpoint and a stop
    (default SIGTERM, what schedulers and ``torchrun`` send before killing a job). ``timeout``: seconds
    every rank waits for the others in the checkpointer's agreements.

    ``key``: the secret that signs and verifies checkpoints (bytes, or a key file's path; default: see
    ``flexsp.checkpoint.trust``). ``trust_unsigned=True`` is the explicit trust override: restore a
    checkpoint whose record is not signed with this key (another user's, an older format's signature
    aside), still checking every file against its manifest; only for checkpoints you trust.
    """

    def __init__(self, directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 loader: Any = None, every: int = 100, keep: int = 2, extra: Mapping[str, Any] | None = None,
                 signals: Sequence[int] = (signal.SIGTERM,), timeout: float = DEFAULT_TIMEOUT,
                 key: bytes | str | os.PathLike | None = None, trust_unsigned: bool = False,
                 control: ControlGroup | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise CheckpointError(f"every must be an integer >= 0 (0: save only on a signal), got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be an integer >= 1, got {keep!r}")
        for name, obj in (extra or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise CheckpointError(f"extra[{name!r}] needs state_dict() and load_state_dict(), "
                                      f"got {type(obj).__name__}")
        self.directory = Path(directory)
        self._key, self._key_source, key_file = trust.resolve_key(key)
        if key_file is not None and key_file.resolve().is_relative_to(self.directory.resolve()):
            raise CheckpointError(f"{key_file}: the checkpoint key must not live in the checkpoint directory "
                                  f"{self.directory}: whoever can write checkpoints could then sign them")
        self.trust_unsigned = bool(trust_unsigned)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.every, self.keep = every, keep
        self.extra = dict(extra or {})
        self._owns_control = control is None
        self.control = control if control is not None else ControlGroup(timeout)
        self.rank, self.world_size = self.control.rank, self.control.world_size
        self.step = 0                     # optimizer steps completed (restored by ``restore``)
        self.last_saved: Path | None = None
        self._signalled = threading.Event()
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    # --- the loop's two calls -------------------------------------------------------------------
    def step_done(self) -> bool:
        """Count one optimizer step; save when due or when any rank got a signal. True: stop now.

        One tiny host all-reduce per call, so that a signal seen by one rank stops every rank at the
        same step (a scheduler's SIGTERM does not reach all ranks at the same instant).
        """
        self.step += 1
        stop = self.control.any(self._signalled.is_set(), what=f"checkpoint signal check at step {self.step}",
                                error=CheckpointError)
        if stop or (self.every and self.step % self.every == 0):
            self.save()
        return stop

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Load ``path``, or the newest committed checkpoint that verifies (an older one, with a warning,
        if the newest is damaged). Returns the restored step (0 and no change when there is none)."""
        if path is not None:
            self._load(Path(path))
            return self.step
        candidates = self.control.gather([str(p) for _, p in layout.committed(self.directory)] if self.rank == 0
                                         else None, what="listing checkpoints", error=CheckpointError)[0]
        problems = []
        for candidate in map(Path, candidates):
            try:
                self._load(candidate)
                if problems and self.rank == 0:
                    warnings.warn(f"restored the older checkpoint {candidate}: " + "; ".join(problems), stacklevel=2)
                return self.step
            except _Damaged as exc:
                problems.append(str(exc))
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(problems))
        return 0

    # --- saving ---------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step now (collective: every rank calls it)."""
        step = self.step
        partial = self.directory / layout.partial_name(step)
        final = self.directory / layout.final_name(step)
        what = f"saving checkpoint {final}"
        failure = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir()
            except OSError as exc:
                failure = error_line(exc)
        self.control.check(failure, what=what, error=CheckpointError)
        try:
            with _quiet_single_process():
                dcp.save(self._state(), checkpoint_id=str(partial))
        except (Exception, CheckpointException) as exc:   # DCP shares a writer's error with every rank itself
            raise CheckpointError(f"{what}: {_short(exc)}") from None
        rng = self.control.gather(_rng_state(), what=what, error=CheckpointError)
        failure, listing = None, None
        if self.rank == 0:
            try:
                with open(partial / layout.RNG, "wb") as f:   # synced like DCP's shards: commit syncs directories only
                    torch.save(rng, f)
                    f.flush()
                    os.fsync(f.fileno())
                listing = layout.files_of(partial)   # one listing for all: another node's view may be stale
            except Exception as exc:
                failure = error_line(exc)
        self.control.check(failure, what=what, error=CheckpointError)
        names = self.control.gather(listing, what=what, error=CheckpointError)[0]
        try:
            mine = layout.describe(partial, names[self.rank::self.world_size])
        except OSError as exc:
            failure, mine = error_line(exc), {}
        self.control.check(failure, what=what, error=CheckpointError)
        manifest: dict[str, list[int]] = {}
        for part in self.control.gather(mine, what=what, error=CheckpointError):
            manifest.update(part)
        failure = None
        if self.rank == 0:
            try:
                record = layout.Record(step=step, world_size=self.world_size, files=manifest,
                                       loader=self.loader.state_dict() if self.loader is not None else None,
                                       skipped=_skipped(self.loader), extra={"torch": torch.__version__})
                layout.write_record(partial, record, self._key)
                layout.commit(partial, final)
                layout.prune(self.directory, self.keep)
            except Exception as exc:   # whatever it is, every rank must hear of it
                failure = error_line(exc)
        self.control.check(failure, what=what, error=CheckpointError)
        self.last_saved = final
        return final

    def _state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        for name, obj in self.extra.items():
            state[f"extra.{name}"] = obj.state_dict()
        return state

    # --- loading --------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        what = f"restoring checkpoint {path}"
        failure = None
        try:
            record = layout.read_record(path, None if self.trust_unsigned else self._key,
                                        key_source=self._key_source)
            names = sorted(record.files)
            layout.verify(path, record, names[self.rank::self.world_size])
        except CheckpointError as exc:
            failure = str(exc)
        # every file was hashed by some rank and matched its signed manifest before anything reads it
        self.control.check(failure, what=what, error=_Damaged)
        if self.trust_unsigned and self.rank == 0:
            warnings.warn(f"{path}: restored with trust_unsigned=True: its record's signature was not checked",
                          stacklevel=3)
        failure = None
        if self.rank == 0 and self.loader is not None and record.skipped != _skipped(self.loader):
            failure = (f"{path / layout.META}: the epoch saved by {record.world_size} ranks left out "
                       f"{(record.skipped or [0])[0]} too-long sequence(s); on this world of {self.world_size} the "
                       f"largest SP group holds a different set ({(_skipped(self.loader) or [0])[0]}), so resuming "
                       f"would lose or repeat sequences: resume on {record.world_size} ranks, or start a new epoch")
        self.control.check(failure, what=what, error=CheckpointError)
        state = self._state()
        _check_shapes(path, state["model"])
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafeLoadPlanner())
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"{what}: {_short(exc)}") from None
        try:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except Exception as exc:
            raise CheckpointError(f"{what}: the saved optimizer/model state does not fit: {_short(exc)}") from None
        for name, obj in self.extra.items():
            obj.load_state_dict(state[f"extra.{name}"])
        if self.loader is not None:
            if record.loader is None:
                raise CheckpointError(f"{path / layout.META}: saved without a loader state, but a loader was given")
            failure = None
            try:   # checked on every rank (the dataset's digest on the planning rank): agreed below
                self.loader.load_state_dict(record.loader, world_size_change=True)
            except Exception as exc:
                failure = f"the saved loader state does not fit this loader: {exc}"
            self.control.check(failure, what=f"restoring the loader from {path / layout.META}", error=CheckpointError)
        if record.world_size == self.world_size:
            failure = None
            try:   # agreed: a rank that cannot restore its generators must not leave the others to a collective
                states = torch.load(path / layout.RNG, weights_only=True)
                _set_rng_state(states[self.rank])
            except Exception as exc:
                failure = f"{path / layout.RNG}: unreadable RNG state: {_short(exc)}"
            self.control.check(failure, what=f"restoring the RNG state from {path / layout.RNG}", error=CheckpointError)
        elif self.rank == 0:
            warnings.warn(f"{path}: saved by {record.world_size} ranks, restored on {self.world_size}: model, "
                          f"optimizer and loader are exact, per-rank RNG streams start afresh", stacklevel=3)
        self.step = record.step
        self.last_saved = path

    # --- signals --------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled.set()   # act at the next step boundary, where every rank can agree

    @property
    def signalled(self) -> bool:
        return self._signalled.is_set()

    def close(self) -> None:
        """Put the previous signal handlers back and release the side group this checkpointer made."""
        if self._owns_control:
            self.control.close()
            self._owns_control = False
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Damaged(CheckpointError):
    """A checkpoint's files fail verification: ``restore()`` falls back to an older one."""


def _skipped(loader: Any) -> list[int] | None:
    """Which sequences the loader's epochs leave out as too long (``FlexSPLoader.left_out``; None for a
    loader without that method or not skipping)."""
    left_out = getattr(loader, "left_out", None)
    return left_out() if callable(left_out) else None


def _check_shapes(path: Path, model_state: Mapping[str, Any]) -> None:
    """Compare the model's parameters with the checkpoint's metadata: a clear error, not DCP's traceback."""
    try:
        saved = _SafeReader(str(path)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{path / '.metadata'}: unreadable DCP metadata: {_short(exc)}") from None
    saved_model = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    missing = sorted(set(model_state) - set(saved_model))
    unexpected = sorted(set(saved_model) - set(model_state))
    if missing or unexpected:
        raise CheckpointError(f"{path}: the model does not match the checkpoint: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for name, value in model_state.items():
        size = getattr(saved_model[name], "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(f"{path}: parameter {name!r} is {list(size)} in the checkpoint but "
                                  f"{list(value.shape)} in this model")


# What DCP's ``.metadata`` pickle may name: its metadata dataclasses, torch sizes and dtypes, paths.
# Nothing else is importable from it, so even a forged file cannot call a function.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in
    ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
     "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which is not allowed")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, but ``.metadata`` goes through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"DCP metadata is a {type(metadata).__name__}, not Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but non-tensor items (optimizer hyper-parameters, extra state) are read with
    ``weights_only=True``: plain values and tensors only, never an arbitrary object."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"item {read_item.dest_index.fqn!r}: refused ({_short(exc)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it runs without a process group; for one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _short(exc: BaseException) -> str:
    """DCP wraps each rank's traceback; keep the type and first line that says what went wrong."""
    text = str(exc).strip()
    raised = re.findall(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$", text, flags=re.MULTILINE)
    if raised and raised[-1][0] != type(exc).__name__:   # the innermost exception a rank raised
        return f"{raised[-1][0]}: {raised[-1][1].strip()}"[:500]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("File ", "Traceback"))]
    return f"{type(exc).__name__}: {lines[0] if lines else text[:200]}"[:500]


def _rng_state() -> dict[str, Any]:
    """This rank's generators. On CUDA only its own device's (``current_device``): device numbers depend on what
    the launcher makes visible (one GPU per task under srun, all of them under torchrun), the rank does not."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda_device": (torch.cuda.get_rng_state(torch.cuda.current_device())
                            if torch.cuda.is_available() else None),
            "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]]}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        if state.get("cuda_device") is not None:
            torch.cuda.set_rng_state(state["cuda_device"], device)
        elif state.get("cuda"):   # saved by an earlier release: every visible device's, by number
            saved = state["cuda"]
            if len(saved) == 1:        # one visible device: it was this rank's, whatever its number is now
                torch.cuda.set_rng_state(saved[0], device)
            elif device < len(saved):
                torch.cuda.set_rng_state(saved[device], device)
            else:
                warnings.warn(f"the checkpoint's CUDA generators are those of {len(saved)} visible devices and this "
                              f"rank runs on cuda:{device}: its CUDA stream starts afresh", stacklevel=4)
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
