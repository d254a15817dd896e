"""Readers of files a user did not write: lengths text, cost model keys, ``--bandwidth`` tables, JSON objects.

Each bad input is one ``FlexSPError`` line naming the problem, in linear time; nothing is read as some other
number (``"08"`` as 8, ``"1_000"`` as 1000, ``true`` as 1.0), and no two keys silently collapse into one."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flexsp.errors import CostModelError, LengthsError, PlanError
from flexsp.plan.cost import CostModel
from flexsp.plan.lengths import load_lengths, locate
from flexsp.plan.presets import cost_from_preset
from flexsp.plan.types import Plan
from flexsp.replay.comm_time import load_bandwidth_table, parse_bandwidth_table

BASE = cost_from_preset("gpt-7b", num_gpus=8).to_dict()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# --- lengths text ------------------------------------------------------------------------------------------
def test_a_line_without_end_is_refused_in_linear_time(tmp_path: Path):
    """Before: the unfinished line was rebuilt every 1 MiB chunk (208 MiB of '1': 21 s, 470 MB)."""
    path = tmp_path / "noline.txt.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"7\n" + b"1" * (8 << 20))
    with pytest.raises(LengthsError, match=r"noline\.txt\.gz, line 2: over 65536 bytes long") as exc:
        load_lengths(path)
    _one_line(exc)


def test_line_ends_across_chunks_keep_their_line_numbers(tmp_path: Path):
    crlf = tmp_path / "crlf.txt"     # 1 MiB chunks end between a \r and its \n
    crlf.write_bytes(b"9\n" + b"1\r\n" * 400_000 + b"\n" * (1 << 20) + b"x\n")
    with pytest.raises(LengthsError, match=rf"line {400_002 + (1 << 20)}: 'x' is not an integer"):
        load_lengths(crlf)
    lone_cr = tmp_path / "cr.txt"    # old Mac line ends: no \n at all, more than the line cap
    lone_cr.write_bytes(b"12\r" * 400_000 + b"3")
    lengths = load_lengths(lone_cr)
    assert lengths.size == 400_001 and set(lengths[:-1].tolist()) == {12} and lengths[-1] == 3
    assert locate(lone_cr, 400_000) == f"{lone_cr} line 400001"


@pytest.mark.parametrize("line", ["\u00b2", "1_000", "+100", "\u0661\u0662", "\uff11\uff12", "\u00a07", "0x10",
                                  "1e3", "12\x0c"])
def test_a_length_is_ascii_digits_only(tmp_path: Path, line: str):
    """Before: '\u00b2' was "a 1-digit number"; '1_000', '+100', Arabic-Indic and full-width digits were read as
    numbers."""
    path = tmp_path / "l.txt"
    path.write_text(f"5\n{line}\n6\n", encoding="utf-8")
    with pytest.raises(LengthsError, match=r"l\.txt, line 2: '.*' is not an integer in ASCII digits 0-9") as exc:
        load_lengths(path)
    _one_line(exc)


def test_documented_text_formats_still_load(tmp_path: Path):
    path = tmp_path / "ok.txt"
    path.write_bytes(b"\xef\xbb\xbf 5\t\r\n\n007\n  \n9223372036854775807")
    assert load_lengths(path).tolist() == [5, 7, 2**63 - 1]
    path.write_text("5\n-4\n")
    with pytest.raises(LengthsError, match=r"line 2: -4 is not a valid sequence length"):
        load_lengths(path)
    path.write_text("5\n9223372036854775808\n")
    with pytest.raises(LengthsError, match=r"line 2: 9223372036854775808 is not a valid sequence length"):
        load_lengths(path)


def test_a_bad_byte_is_named_not_a_decoding_traceback(tmp_path: Path):
    path = tmp_path / "l.txt"
    path.write_bytes(b"5\n6\xff\n")
    with pytest.raises(LengthsError, match=r"line 2: '6\ufffd' is not an integer"):
        load_lengths(path)


# --- cost model keys ---------------------------------------------------------------------------------------
def _cost(**change) -> CostModel:
    return CostModel.from_dict({**BASE, **change})


@pytest.mark.parametrize("change, message", [
    ({"alltoall_bandwidth": {**BASE["alltoall_bandwidth"], "\u00b2": 1e9}},
     r"alltoall_bandwidth keys must be integer SP degrees, got '\u00b2'"),
    ({"alltoall_bandwidth": {**BASE["alltoall_bandwidth"], "08": 1.0}}, "got '08'"),
    ({"alltoall_bandwidth": {**BASE["alltoall_bandwidth"], " 2 ": 1.0}}, "got ' 2 '"),
    ({"alltoall_bandwidth": {**BASE["alltoall_bandwidth"], "+4": 1.0}}, r"got '\+4'"),
    ({"alltoall_bandwidth": {**BASE["alltoall_bandwidth"], 8: 1.0}}, "names integer SP degree 8 twice"),
    ({"window_alpha": {"4096": 1e-9, " 4096": 5e-9}}, "window_alpha keys must be token sizes, got ' 4096'"),
    ({"chunk_alpha": {"512": 1e-9, 512: 5e-9}}, "chunk_alpha names token size 512 twice"),
    ({"chunk_alpha": {"\u0665\u0661\u0662": 1e-9}}, "chunk_alpha keys must be token sizes"),
])
def test_cost_model_keys_name_one_number_each(change, message):
    """Before: '\u00b2' was a ValueError traceback; '8' and '08' named one degree and the later won (a plan
    predicted 51,943,309,335 s instead of 21.1 s)."""
    with pytest.raises(CostModelError, match=message) as exc:
        _cost(**change)
    _one_line(exc)


def test_canonical_keys_still_load_and_round_trip(tmp_path: Path):
    cost = _cost(alltoall_bandwidth={2: 1e11, "4": 1e11, "8": 9e10}, window_alpha={"4096": 1e-9}, chunk_alpha={512: 1e-9})
    assert cost.alltoall_bandwidth == {2: 1e11, 4: 1e11, 8: 9e10}
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cost


# --- JSON objects ------------------------------------------------------------------------------------------
def test_a_key_twice_in_a_json_object_is_refused(tmp_path: Path):
    """json keeps the later of two equal keys silently; every FlexSP reader refuses it instead."""
    text = json.dumps(BASE)
    cost = tmp_path / "cost.json"
    cost.write_text(text.replace('"alltoall_bandwidth": {', '"alltoall_bandwidth": {"8": 1.0, ', 1))
    with pytest.raises(CostModelError, match=r"cost\.json has the key '8' twice in one object") as exc:
        CostModel.load(cost)
    _one_line(exc)
    cost.write_text(text.replace('{"alpha1": ', '{"alpha1": 1.0, "alpha1": ', 1))
    with pytest.raises(CostModelError, match="has the key 'alpha1' twice"):
        CostModel.load(cost)
    plan = tmp_path / "plan.json"
    plan.write_text('{"num_gpus": 1, "num_gpus": 8, "predicted_time": 1.0, "micro_batches": []}')
    with pytest.raises(PlanError, match="has the key 'num_gpus' twice"):
        Plan.load(plan)


# --- --bandwidth tables ------------------------------------------------------------------------------------
@pytest.mark.parametrize("table, message", [
    ({"2": "5e9"}, r"bandwidth table\[2\] \(bytes/s\) must be a number, got '5e9'"),
    ({"4": True}, r"bandwidth table\[4\] \(bytes/s\) must be a number, got True"),
    ({"8": 1e9, "08": 1e12}, "keys must be SP degrees, got '08'"),
    ({"1_6": 3e9}, "keys must be SP degrees, got '1_6'"),
    ({"\u00b2": 3e9}, "keys must be SP degrees"),
    ({8: 1e9, "8": 1e12}, "names SP degree 8 twice"),
    ({"2": float("nan")}, "must be finite"),
    ({"2": 0}, "must be > 0"),
    ({"1": 1e9}, "needs a degree >= 2"),
])
def test_a_bandwidth_table_is_read_strictly(table, message):
    """Before: {"2":"5e9","4":true,"8":1e9,"08":1e12,"1_6":3e9} loaded as {2: 5e9, 4: 1.0, 8: 1e12, 16: 3e9}."""
    with pytest.raises(CostModelError, match=message) as exc:
        parse_bandwidth_table(table)
    _one_line(exc)


def test_a_good_bandwidth_table_loads(tmp_path: Path):
    path = tmp_path / "bw.json"
    path.write_text('{"alltoall_bandwidth": {"16": 2e9, "2": 5000000000}}')
    assert load_bandwidth_table(path) == {2: 5e9, 16: 2e9}
    path.write_text('{"2": 5e9, "2": 1e12}')
    with pytest.raises(CostModelError, match=r"bw\.json has the key '2' twice"):
        load_bandwidth_table(path)
