"""Property tests: corrupted checkpoints and length files give a FlexSP error naming the file and the
problem (or, where the damage is harmless, load the same content); never another exception or a hang."""
import gzip
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fault.common import MODEL, SeenCounter, flat_params  # noqa: E402
from flexsp.checkpoint import (  # noqa: E402
    Checkpointer,
    CheckpointError,
    layout,  # noqa: E402
)
from flexsp.errors import FlexSPError, LengthsError  # noqa: E402
from flexsp.plan.lengths import load_lengths  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _job():
    from flexsp.runtime import TinyLM
    torch.manual_seed(0)
    model = TinyLM(MODEL).double()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One good checkpoint after two Adam steps, and the parameters it holds."""
    directory = tmp_path_factory.mktemp("ckpt")
    model, opt = _job()
    for _ in range(2):
        opt.zero_grad()
        model(torch.arange(10)).square().mean().backward()
        opt.step()
    with Checkpointer(directory, model, opt, every=0, extra={"seen": SeenCounter(5)}) as ckpt:
        ckpt.step = 2
        path = ckpt.save()
    return path, flat_params(model)


def _restore(path):
    model, opt = _job()
    with Checkpointer(path.parent, model, opt, every=0, extra={"seen": SeenCounter(5)}) as ckpt:
        ckpt.restore(path)
    return flat_params(model)


corruption = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64), st.just(0)),
    st.tuples(st.just("delete"), st.just(0), st.just(0)),
    st.tuples(st.just("replace"), st.binary(max_size=200), st.just(0)),
)


def _damage(file: Path, how) -> None:
    kind, a, b = how
    raw = bytearray(file.read_bytes())
    if kind == "flip" and raw:
        raw[int(a * len(raw))] ^= b
    elif kind == "truncate":
        raw = raw[:int(a * len(raw))]
    elif kind == "append":
        raw += a
    elif kind == "replace":
        raw = bytearray(a)
    if kind == "delete":
        file.unlink()
    else:
        file.write_bytes(bytes(raw))


@SETTINGS
@given(pick=st.integers(0, 100), how=corruption)
def test_a_corrupted_checkpoint_file_is_named_in_a_checkpoint_error(saved, pick, how):
    original, params = saved
    names = sorted(p.name for p in original.iterdir())
    assert {"flexsp.json", ".metadata", "rng.pt"} <= set(names)
    name = names[pick % len(names)]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / original.name
        shutil.copytree(original, copy)
        before = (copy / name).read_bytes()
        _damage(copy / name, how)
        if (copy / name).exists() and (copy / name).read_bytes() == before:
            return   # e.g. an empty append: nothing was damaged
        try:
            restored = _restore(copy)
        except CheckpointError as exc:
            assert name in str(exc), str(exc)
            return
        except Exception as exc:   # anything else is a bug
            pytest.fail(f"{type(exc).__name__} instead of CheckpointError for {how} on {name}: {exc}")
        # only a change JSON ignores (whitespace) in the record may load, and then it loads the same state
        assert name == layout.META and torch.equal(restored, params), (name, how)


def test_the_newest_damaged_checkpoint_alone_is_an_error_naming_it(saved, tmp_path):
    original, _ = saved
    copy = tmp_path / original.name
    shutil.copytree(original, copy)
    (copy / ".metadata").write_bytes(b"not a pickle")
    model, opt = _job()
    with Checkpointer(tmp_path, model, opt, extra={"seen": SeenCounter(5)}) as ckpt:
        with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*\.metadata: .*bytes but"):
            ckpt.restore()


WHY = {"deep": "nested too deeply", "long number": "not valid JSON: Exceeds the limit", "fifo": "not a regular file"}


@pytest.mark.parametrize("damage", sorted(WHY))
def test_a_record_the_json_parser_chokes_on_falls_back_to_the_older_checkpoint(saved, tmp_path, damage):
    """A record nested 100,000 deep or holding a 5,000-digit number raised RecursionError / ValueError, which
    restore()'s fallback (it catches CheckpointError) let escape; a FIFO in its place blocked the read."""
    import os
    original, params = saved
    older = tmp_path / original.name
    shutil.copytree(original, older)
    newer = tmp_path / layout.final_name(int(original.name.split("-")[-1]) + 1)
    shutil.copytree(original, newer)
    record = newer / layout.META
    record.unlink()
    if damage == "deep":
        record.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "long number":
        record.write_text('{"step": ' + "9" * 5000 + "}")
    else:
        os.mkfifo(record)
    stop = threading.Event()

    def release() -> None:   # a reader blocked on the FIFO (the defect) gets EOF after 10 s: a failure, not a hang
        while not stop.wait(0.2):
            if time.monotonic() > started + 10:
                try:
                    os.close(os.open(record, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    started = time.monotonic()
    threading.Thread(target=release, daemon=True).start()
    try:
        with pytest.raises(CheckpointError, match=f"{newer.name}.*flexsp.json.*{WHY[damage]}"):
            _restore(newer)
        model, opt = _job()
        with Checkpointer(tmp_path, model, opt, every=0, extra={"seen": SeenCounter(5)}) as ckpt:
            ckpt.restore()
        assert torch.equal(flat_params(model), params)
    finally:
        stop.set()


# --- length files --------------------------------------------------------------------------------

GOOD = [5, 17, 300, 2048, 1]


def _write(path: Path, payload: bytes) -> None:
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


@SETTINGS
@example(suffix=".txt.gz", how=("flip", 0.5, 8), raw_gz=True)   # was a bare zlib.error
@given(suffix=st.sampled_from([".txt", ".txt.gz", ".npy", ".lengths"]), how=corruption,
       raw_gz=st.booleans())
def test_a_corrupted_lengths_file_is_named_in_a_lengths_error(tmp_path, suffix, how, raw_gz):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"lengths{suffix}"
        if suffix == ".npy":
            np.save(path, np.array(GOOD, dtype=np.int64))
        else:
            _write(path, "\n".join(map(str, GOOD)).encode())
        if suffix == ".txt.gz" and not raw_gz:   # damage the text inside a well-formed gzip
            text = path.with_suffix("")
            text.write_bytes(gzip.decompress(path.read_bytes()))
            _damage(text, how)
            if text.exists():
                _write(path, text.read_bytes())
            else:
                path.unlink()
        else:
            _damage(path, how)
        try:
            lengths = load_lengths(path)
        except LengthsError as exc:
            assert str(path) in str(exc) or path.name in str(exc), str(exc)
            return
        except FlexSPError as exc:
            pytest.fail(f"{type(exc).__name__} rather than LengthsError: {exc}")
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__} instead of LengthsError for {how} on {path.name}: {exc}")
        # whatever still loads is a valid batch of positive integer lengths
        assert lengths.ndim == 1 and lengths.size > 0 and (lengths >= 1).all()
