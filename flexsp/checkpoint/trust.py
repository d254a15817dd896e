"""The key that signs checkpoints: who may write a checkpoint this job will restore. Torch-free.

A checkpoint's commit record carries an HMAC-SHA256 over its manifest (every file's SHA-256) made with a
secret that never lives in the checkpoint directory, so whoever can write the directory but does not
hold the secret cannot make a checkpoint that restores. Where the secret comes from, first match wins:

1. the ``key`` argument of ``Checkpointer`` (bytes: the secret itself; a path: a key file);
2. ``FLEXSP_CHECKPOINT_KEY`` (the secret as text) or ``FLEXSP_CHECKPOINT_KEY_FILE`` (a key file), so
   every rank of a cluster job shares one key;
3. a per-user key file, ``$XDG_CONFIG_HOME/flexsp/checkpoint.key`` (``~/.config/...``), created with
   32 random bytes and mode 0600 on first use (the way Jupyter signs the notebooks it trusts).

A key file readable or writable by group or others is refused, as ssh refuses such a private key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from flexsp.checkpoint.errors import CheckpointError

ENV_KEY = "FLEXSP_CHECKPOINT_KEY"
ENV_KEY_FILE = "FLEXSP_CHECKPOINT_KEY_FILE"
MIN_KEY_BYTES = 16


def default_key_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "flexsp" / "checkpoint.key"


def resolve_key(key: bytes | str | os.PathLike | None = None) -> tuple[bytes, str, Path | None]:
    """The signing secret, where it came from (for messages; never the secret itself), its file if any."""
    if isinstance(key, (bytes, bytearray)):
        return _checked(bytes(key), "the key argument"), "the key argument", None
    if key is not None:
        return _read_key_file(Path(key), create=False), f"key file {key}", Path(key)
    if os.environ.get(ENV_KEY):
        return _checked(os.environ[ENV_KEY].encode(), f"${ENV_KEY}"), f"${ENV_KEY}", None
    if os.environ.get(ENV_KEY_FILE):
        path = Path(os.environ[ENV_KEY_FILE])
        return _read_key_file(path, create=False), f"key file {path} (${ENV_KEY_FILE})", path
    path = default_key_file()
    return _read_key_file(path, create=True), f"key file {path}", path


def sign(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def signed_by(key: bytes, body: bytes, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(key, body), signature)


def _checked(secret: bytes, source: str) -> bytes:
    if len(secret) < MIN_KEY_BYTES:
        raise CheckpointError(f"{source}: a checkpoint key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
    return secret


def _read_key_file(path: Path, *, create: bool) -> bytes:
    if create and not path.exists():
        _create_key_file(path)
    try:
        info = os.stat(path, follow_symlinks=True)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CheckpointError(f"{path}: the checkpoint key file is accessible to group/others (mode "
                                  f"{stat.S_IMODE(info.st_mode):o}); run chmod 600 {path}")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise CheckpointError(f"{path}: the checkpoint key file belongs to another user")
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint key ({exc.strerror or exc})") from None
    return _checked(secret, str(path))


def _create_key_file(path: Path) -> None:
    """Write a new random key atomically: several ranks on one host may race to create it."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)          # fails if another process made it first: theirs wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot create the checkpoint key ({exc.strerror or exc}); set "
                              f"${ENV_KEY_FILE} to a key file") from None
