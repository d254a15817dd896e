"""A checkpoint runs no code and restores only when signed with this job's key (issue 31, point 1).

Each attack edits a good checkpoint the way someone who can write the directory but lacks the key
would, and then re-computes the manifest so the unkeyed checks of old would pass: a crafted pickle in
DCP's ``.metadata`` and in a non-tensor item must not run (a marker file must not appear), a
re-computed manifest must be refused, symlinks refused, and the trust override must still run no code.
"""
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from fault.common import MODEL, SeenCounter, flat_params  # noqa: E402
from flexsp.checkpoint import Checkpointer, CheckpointError, layout, trust  # noqa: E402


class _Payload:
    """Unpickling this creates ``path``: proof that code from the checkpoint ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _job(lr=1e-2):
    from flexsp.runtime import TinyLM
    torch.manual_seed(0)
    model = TinyLM(MODEL).double()
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _save(directory: Path, **kwargs) -> Path:
    model, opt = _job()
    opt.zero_grad()
    model(torch.arange(10)).square().mean().backward()
    opt.step()
    with Checkpointer(directory, model, opt, every=0, extra={"seen": SeenCounter(5)}, **kwargs) as ckpt:
        ckpt.step = 1
        return ckpt.save()


def _restore(path: Path, **kwargs):
    model, opt = _job(lr=0.5)
    with Checkpointer(path.parent, model, opt, every=0, extra={"seen": SeenCounter(5)}, **kwargs) as ckpt:
        ckpt.restore(path)
    return model, opt


def _remanifest(path: Path, signature: str = "0" * 64) -> None:
    """What an attacker without the key can do: re-hash every file into the record."""
    meta = path / layout.META
    record = json.loads(meta.read_text())
    record["files"] = layout.describe(path, layout.files_of(path))
    record["hmac"] = signature
    meta.write_text(json.dumps(record))


def _swap_in(path: Path, state: dict) -> None:
    """Replace the DCP files by a DCP save of ``state`` (same keys, attacker's values)."""
    for name in layout.files_of(path):
        if name != layout.RNG:
            (path / name).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def _evil_state(marker: Path) -> dict:
    model, opt = _job()
    opt.zero_grad()
    model(torch.arange(10)).square().mean().backward()
    opt.step()
    model_state, optim_state = get_state_dict(model, opt)
    optim_state["param_groups"][0]["lr"] = _Payload(marker)     # a non-tensor item: stored as a pickle
    return {"model": model_state, "optim": optim_state, "extra.seen": SeenCounter(5).state_dict()}


def test_a_good_checkpoint_restores_and_the_key_file_is_private(tmp_path):
    path = _save(tmp_path / "ckpt")
    model, opt = _restore(path)
    assert opt.param_groups[0]["lr"] == 1e-2                  # a non-tensor item, read back as a value
    reference, _ = _job()
    assert not torch.equal(flat_params(model), flat_params(reference))   # the step's update came back
    key_file = trust.default_key_file()
    assert key_file.is_file() and (key_file.stat().st_mode & 0o777) == 0o600


def test_a_recomputed_manifest_without_the_key_is_refused(tmp_path):
    path = _save(tmp_path / "ckpt")
    victim = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    _remanifest(path)
    with pytest.raises(CheckpointError, match=f"{layout.META}: the record is not signed"):
        _restore(path)
    # a record signed with another key (another user's checkpoint) is refused the same way
    _remanifest(path, trust.sign(b"someone else's key, 32 bytes ..", b"x"))
    with pytest.raises(CheckpointError, match="not signed"):
        _restore(path)


def test_a_crafted_pickle_in_the_metadata_runs_no_code(tmp_path):
    path = _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned-metadata"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _remanifest(path)
    with pytest.raises(CheckpointError, match="not signed"):
        _restore(path)
    assert not marker.exists()
    # even with the explicit trust override, the metadata reader only builds DCP's own classes
    with pytest.raises(CheckpointError, match=r"\.metadata.*Path\.touch|pathlib.*touch|not allowed"):
        _restore(path, trust_unsigned=True)
    assert not marker.exists()


def test_a_crafted_pickle_in_a_byte_item_runs_no_code(tmp_path):
    path = _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned-item"
    _swap_in(path, _evil_state(marker))
    _remanifest(path)
    with pytest.raises(CheckpointError, match="not signed"):
        _restore(path)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="param_groups.0.lr"):
        _restore(path, trust_unsigned=True)
    assert not marker.exists()


def test_trust_override_loads_another_keys_checkpoint_but_still_checks_files(tmp_path):
    path = _save(tmp_path / "ckpt", key=b"k" * 32)
    with pytest.raises(CheckpointError, match="not signed with the key argument"):
        _restore(path, key=b"j" * 32)
    with pytest.warns(UserWarning, match="trust_unsigned=True"):
        model, _ = _restore(path, key=b"j" * 32, trust_unsigned=True)
    signed, _ = _restore(path, key=b"k" * 32)
    assert torch.equal(flat_params(model), flat_params(signed))
    (path / "added.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="added.bin: not listed"):
        _restore(path, key=b"j" * 32, trust_unsigned=True)


def test_symlinks_are_refused(tmp_path):
    path = _save(tmp_path / "ckpt")
    victim = next(p for p in path.iterdir() if p.suffix == ".distcp")
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(victim.read_bytes())
    victim.unlink()
    victim.symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"{victim.name}: a symlink"):
        _restore(path)


def test_key_sources_and_permissions(tmp_path, monkeypatch):
    key_file = tmp_path / "job.key"
    key_file.write_text("s" * 40)
    os.chmod(key_file, 0o644)
    with pytest.raises(CheckpointError, match="accessible to group/others"):
        trust.resolve_key(key_file)
    os.chmod(key_file, 0o600)
    monkeypatch.setenv(trust.ENV_KEY_FILE, str(key_file))
    assert trust.resolve_key()[0] == b"s" * 40
    monkeypatch.setenv(trust.ENV_KEY, "e" * 20)
    assert trust.resolve_key()[0] == b"e" * 20
    with pytest.raises(CheckpointError, match="at least 16 bytes"):
        trust.resolve_key(b"short")
    inside = tmp_path / "ckpt" / "job.key"
    inside.parent.mkdir()
    inside.write_text("s" * 40)
    os.chmod(inside, 0o600)
    model, opt = _job()
    with pytest.raises(CheckpointError, match="must not live in the checkpoint directory"):
        Checkpointer(tmp_path / "ckpt", model, opt, key=inside)
