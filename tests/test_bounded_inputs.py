"""Bounded parsers with named errors, one reader per format (issue 31, point 4).

Memory ceilings are measured in a fresh subprocess (peak RSS growth while one file is read), so the
test process's own allocations do not count. Every bad input is a one-line ``FlexSPError`` (exit 2 on
the command line), never a traceback; a hypothesis fuzz feeds the lengths, plan, cost and bandwidth
readers arbitrary bytes."""
import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexsp.cli import main
from flexsp.errors import CostModelError, FlexSPError, LengthsError, PlanError
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import load_lengths
from flexsp.plan.types import Plan
from flexsp.replay.comm_time import load_bandwidth_table

ROOT = Path(__file__).resolve().parents[1]


def _peak_growth_mb(code: str, env: dict | None = None) -> tuple[float, str]:
    """Run ``code`` (which reads a file) in a fresh interpreter: (peak RSS growth in MiB, its stdout)."""
    script = textwrap.dedent(f"""
        def kib(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1])
        import numpy as np
        from flexsp.plan.lengths import load_lengths
        from flexsp.errors import FlexSPError
        open("/proc/self/clear_refs", "w").write("5")   # reset the peak: the imports' transient does not count
        before = kib("VmRSS")
        try:
            {code}
        except FlexSPError as exc:
            print("refused:", exc)
        print("growth", (kib("VmHWM") - before) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert out.returncode == 0, out.stderr
    growth = float(out.stdout.strip().splitlines()[-1].split()[1])
    return growth, out.stdout


def test_text_lengths_are_streamed_in_about_the_memory_of_the_result(tmp_path):
    """Before: 15x the file's size (45 MB of lengths: 665 MB). Now the result (8 bytes a length, here
    about the file's size) plus a chunk's scratch; the ceiling is well under the old figure."""
    n = 2_000_000
    values = np.random.default_rng(0).integers(1_000_000, 9_999_999, n)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, values.tolist())) + "\n")
    size_mb = path.stat().st_size / 2**20
    growth, out = _peak_growth_mb(f"a = load_lengths({str(path)!r}); print('n', a.size, int(a.sum()))")
    assert f"n {n} {int(values.sum())}" in out
    assert growth < 2.5 * size_mb + 40, f"{growth:.0f} MiB for a {size_mb:.0f} MiB file"


def test_a_gzip_bomb_stops_at_the_decompressed_cap(tmp_path):
    path = tmp_path / "bomb.txt.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(256):
            f.write(b"1\n" * (1 << 20))          # 512 MiB of text in about 1 MiB of gzip
    growth, out = _peak_growth_mb(f"load_lengths({str(path)!r})",
                                  env={"FLEXSP_MAX_TEXT_BYTES": "16M", "FLEXSP_MAX_SEQUENCES": "1G"})
    assert "refused:" in out and "over the cap of 16777216" in out and "text_bytes" in out
    # what was parsed before the cap (16 MiB of "1\n": 8 M lengths, 64 MiB) plus scratch, not 512 MiB
    assert growth < 120, f"{growth:.0f} MiB"


def test_npy_header_is_checked_against_the_file(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.arange(1, 1001, dtype=np.int64))
    raw = path.read_bytes()
    head = raw[:128].decode("latin1")
    assert load_lengths(path).size == 1000
    shrunk = tmp_path / "shrunk.npy"   # the header edited from 1,000 to 10: was planned as 10 sequences
    shrunk.write_bytes(head.replace("(1000,), ", "(10,),   ").encode("latin1") + raw[128:])
    with pytest.raises(LengthsError, match="header says 10 lengths .* but 8000 bytes follow"):
        load_lengths(shrunk)
    huge = tmp_path / "huge.npy"       # 10^14: was a raw MemoryError
    huge.write_bytes(head.replace("(1000,), ", "(100000000000000,),").ljust(127)[:127].encode("latin1") + b"\n"
                     + raw[128:])
    with pytest.raises(LengthsError, match="over the cap|header says"):
        load_lengths(huge)
    matrix = tmp_path / "matrix.npy"
    np.save(matrix, np.ones((3, 3), dtype=np.int64))
    with pytest.raises(LengthsError, match="1-D"):
        load_lengths(matrix)
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(LengthsError, match="dtype object"):
        load_lengths(objects)


def test_a_plan_over_the_group_cap_is_refused_before_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXSP_MAX_GROUPS", "100")
    plan = {"num_gpus": 1, "predicted_time": 1.0,
            "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [i]}]} for i in range(101)]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="101 groups, over the cap of 100"):
        Plan.load(path)
    monkeypatch.setenv("FLEXSP_MAX_JSON_BYTES", "1K")
    with pytest.raises(PlanError, match="bytes, over the cap of 1024"):
        Plan.load(path)


BAD_JSON = {"deep": b"[" * 100_000 + b"]" * 100_000, "binary": b"\xff\xfe\x00{\x80\x81",
            "huge-number": b'{"2": ' + b"9" * 400 + b"}"}


@pytest.mark.parametrize("kind", sorted(BAD_JSON))
@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_bandwidth_files_get_the_shared_reader(tmp_path, capsys, kind, command):
    """Before: RecursionError / UnicodeDecodeError tracebacks from ``--bandwidth``, on both commands."""
    table = tmp_path / "bw.json"
    table.write_bytes(BAD_JSON[kind])
    if command == "replay":
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"num_gpus": 64, "predicted_time": 1.0,
                                    "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [0]}]}]}))
        lengths = tmp_path / "lengths.txt"
        lengths.write_text("8\n")
        argv = ["replay", str(plan), "--lengths", str(lengths), "--preset", "gpt-7b", "--bandwidth", str(table)]
    else:
        argv = ["simulate", "--steps", "1", "--batch-size", "4", "--quiet", "--bandwidth", str(table)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bandwidth table" in err and str(table) in err, err


def test_cli_counts_are_bounded_before_allocating(capsys):
    """Before: ``--batch-size 100000000`` ran silently, then died in a MemoryError (5.2 GiB)."""
    assert main(["simulate", "--batch-size", "100000000", "--steps", "1"]) == 2
    assert "--batch-size 100000000 is over the cap" in capsys.readouterr().err
    assert main(["--max-input", "nonsense=1", "simulate"]) == 2
    assert main(["plan", "lengths.txt", "--gpus", "1000000000"]) == 2        # was a MemoryError traceback
    assert "--gpus 1000000000 is over the cap" in capsys.readouterr().err


READERS = {
    "lengths.txt": lambda p: load_lengths(p),
    "lengths.txt.gz": lambda p: load_lengths(p),
    "lengths.npy": lambda p: load_lengths(p),
    "plan.json": lambda p: Plan.load(p),
    "cost.json": lambda p: CostModel.load(p),
    "bandwidth.json": lambda p: load_bandwidth_table(p),
}

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=4),
                            max_leaves=20)


def _content(name: str, data) -> bytes:
    kind = data.draw(st.sampled_from(["bytes", "json", "valid-ish"]))
    if kind == "bytes":
        raw = data.draw(st.binary(max_size=300))
    elif kind == "json":
        raw = json.dumps(data.draw(_json_values)).encode()
    elif name.startswith("lengths"):
        raw = "\n".join(str(v) for v in data.draw(st.lists(st.integers(-5, 2**64), max_size=20))).encode()
    else:
        raw = json.dumps({"num_gpus": data.draw(st.integers(-1, 9)), "predicted_time": 1.0,
                          "micro_batches": [{"groups": [{"ranks": data.draw(st.lists(st.integers(-1, 9), max_size=3)),
                                                         "seq_ids": [0]}]}],
                          "alpha1": 1e-9, "alltoall_bandwidth": {"2": data.draw(st.floats())}}).encode()
    if name.endswith(".gz"):
        raw = gzip.compress(raw) if data.draw(st.booleans()) else raw
    if name.endswith(".npy") and kind != "bytes":
        import io
        buf = io.BytesIO()
        np.save(buf, np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64))
        raw = buf.getvalue()
        if data.draw(st.booleans()):
            at = data.draw(st.integers(0, len(raw) - 1))
            raw = raw[:at] + bytes([data.draw(st.integers(0, 255))]) + raw[at + 1:]
    return raw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(READERS)), st.data())
def test_fuzz_every_reader_parses_or_names_the_problem(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(_content(name, data))
    try:
        READERS[name](path)
    except FlexSPError as exc:
        assert str(exc) and "\n" not in str(exc).strip()
