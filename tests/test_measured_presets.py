"""Measured presets (flexsp/plan/measured/): the H200 profile loads by name with its provenance, its capacity
and assumed bandwidths follow the setting, a dropped-in file is a preset, and bad files are refused by name."""
from __future__ import annotations

import json
import math
import shutil

import pytest

import flexsp
from flexsp.plan import measured_presets
from flexsp.plan.analytic import alltoall_bandwidth
from flexsp.plan.cost import describe_sources
from flexsp.plan.measured_presets import FOLDER, measured_names, read_preset

H200 = "h200-llama3-8b"


def _document() -> dict:
    return json.loads((FOLDER / f"{H200}.json").read_text())


def test_h200_preset_loads_with_its_provenance_and_labelled_parts():
    assert H200 in measured_names()
    cost = flexsp.cost_from_preset(H200, num_gpus=8)
    profile = _document()["profile"]
    assert (cost.alpha1, cost.alpha2, cost.beta1) == (profile["alpha1"], profile["alpha2"], profile["beta1"])
    # at the setting it was profiled for (8 GPUs, full sharding) the capacity is the one measured on the H200
    assert cost.token_capacity == profile["token_capacity"] == 16692
    provenance = cost.meta["provenance"]
    assert provenance["driver"] == "580.159.04" and provenance["command"].startswith("flexsp profile --model llama3-8b")
    assert cost.meta["device"] == "NVIDIA H200" and cost.meta["torch"] == "2.11.0+cu130"
    assert cost.meta["date"].startswith("2026-11-26")
    assert "1.22% mean / 2.64% max" in provenance["summary"]
    parts = cost.meta["parts"]
    assert parts["compute"].startswith("measured on NVIDIA H200") and parts["memory"].startswith("measured")
    assert "assumed" in parts["alltoall"] and "nvlink-ib" in parts["alltoall"] and "nvlink-ib" in parts["ring"]
    line = describe_sources(cost)
    assert "measured compute" in line and "from the nvlink-ib preset" in line
    assert "driver 580.159.04" in line and "1.22% mean / 2.64% max" in line and "flexsp profile" in line


def test_capacity_is_recomputed_for_gpu_count_sharding_and_context():
    memory = _document()["profile"]["meta"]["memory"]
    free = memory["memory_bytes"] * memory["usable_fraction"]
    cap = {(n, s): flexsp.cost_from_preset(H200, num_gpus=n, sharding=s).token_capacity
           for n in (8, 64) for s in ("full", "grad_optim")}
    params = _document()["profile"]["meta"]["params"]
    # full sharding at 64 GPUs: 16 bytes per parameter over 64 ranks leaves more room than over 8
    assert cap[64, "full"] == math.floor((free - 16 * params / 64) / memory["bytes_per_token"]) > cap[8, "full"]
    # grad_optim keeps the bf16 parameters unsharded: 2 bytes per parameter more per GPU
    assert cap[64, "grad_optim"] == math.floor((free - 2 * params - 16 * params / 64) / memory["bytes_per_token"])
    with pytest.raises(flexsp.CostModelError, match="h200-llama3-8b on 64 GPUs with sharding 'none'"):
        flexsp.cost_from_preset(H200, num_gpus=64, sharding="none")        # 18 bytes x 8B params > 141 GB
    short, long = (flexsp.cost_from_preset(H200, context=c, num_gpus=64) for c in (32 * 1024, 384 * 1024))
    assert short.token_capacity == long.token_capacity                   # rotary: no parameters grow with context
    assert "context_note" not in short.meta and "extrapolate" in long.meta["context_note"]
    assert long.meta["context"] == 384 * 1024 and long.meta["num_gpus"] == 64


def test_assumed_bandwidths_follow_the_node_size_and_plans_use_them():
    figures = _document()["profile"]["meta"]["assumed"]["figures"]
    intra, inter = figures["intra_node_bandwidth"], figures["inter_node_bandwidth"]
    cost = flexsp.cost_from_preset(H200, num_gpus=16, gpus_per_node=4)
    assert cost.alltoall_bandwidth[4] == pytest.approx(alltoall_bandwidth(4, 4, intra, inter))
    assert cost.alltoall_bandwidth[8] == pytest.approx(alltoall_bandwidth(8, 4, intra, inter))   # crosses nodes now
    assert cost.alltoall_bandwidth[8] < flexsp.cost_from_preset(H200, num_gpus=16).alltoall_bandwidth[8]
    assert 12 in cost.alltoall_bandwidth and 32 not in cost.alltoall_bandwidth        # whole nodes, up to 16 GPUs
    assert cost.meta["assumed"]["gpus_per_node"] == 4
    plan = flexsp.plan_batch([40_000, 3_000, 2_000, 900], cost, flexsp.Cluster(16, 4), strategy="flexsp")
    assert max(g.degree for mb in plan.micro_batches for g in mb.groups) >= 4     # 40K tokens > 2 x capacity


def test_a_dropped_in_profile_is_a_preset_without_code_changes(tmp_path, monkeypatch):
    document = _document()
    document["name"] = "h999-llama3-8b"
    document["profile"]["meta"]["device"] = "NVIDIA H999"
    (tmp_path / "h999-llama3-8b.json").write_text(json.dumps(document))
    shutil.copy(FOLDER / f"{H200}.json", tmp_path)
    monkeypatch.setattr(measured_presets, "FOLDER", tmp_path)
    cost = flexsp.cost_from_preset("h999-llama3-8b", num_gpus=8)
    assert cost.meta["preset"] == "h999-llama3-8b" and "NVIDIA H999" in cost.meta["provenance"]["summary"]
    with pytest.raises(flexsp.CostModelError, match="h999-llama3-8b"):
        flexsp.cost_from_preset("no-such-gpu")                       # the error lists what there is


def test_a_preset_with_windowed_layers_keeps_its_terms(tmp_path, monkeypatch):
    """The measured-preset format carries per-kind attention terms (window_alpha, chunk_alpha): a profile of a
    windowed model is a preset whose plans are costed with them; the older files (none) load unchanged."""
    document = _document()
    document["name"] = "h999-windowed"
    document["profile"]["window_alpha"] = {"4096": document["profile"]["alpha1"] / 2}
    (tmp_path / "h999-windowed.json").write_text(json.dumps(document))
    shutil.copy(FOLDER / f"{H200}.json", tmp_path)
    monkeypatch.setattr(measured_presets, "FOLDER", tmp_path)
    cost = flexsp.cost_from_preset("h999-windowed", num_gpus=8)
    plain = flexsp.cost_from_preset(H200, num_gpus=8)
    assert cost.window_alpha == {4096: plain.alpha1 / 2} and plain.window_alpha == {}
    s = 20_000.0
    extra = plain.alpha1 / 2 * (4096**2 + (s - 4096) * (2 * 4096 - 1))
    assert cost.seq_time(s, 1) == pytest.approx(plain.seq_time(s, 1) + extra)


def _bad(document: dict, how: str) -> dict | str:
    if how == "version":
        document["version"] = 3
    elif how == "format":
        document["format"] = "something else"
    elif how == "driver":
        del document["provenance"]["driver"]
    elif how == "name":
        document["name"] = "h100-llama3-8b"
    elif how == "coefficient":
        document["profile"]["alpha1"] = -1.0
    elif how == "fit error":
        del document["profile"]["meta"]["compute"]["mean_abs_rel_error"]
    elif how == "source":
        document["profile"]["meta"]["source"] = "analytic"
    elif how == "not json":
        return "{'format': 'flexsp measured preset'"
    elif how == "oversized":
        document["description"] = "x" * (measured_presets.MAX_PRESET_BYTES + 1)
    return document


@pytest.mark.parametrize("how, message", [
    ("version", "format version 3 is not supported; this FlexSP reads versions 1, 2"),
    ("format", "not a measured preset: format is 'something else'"),
    ("driver", r"provenance.driver must be a str"),
    ("name", "must .* equal the file name"),
    ("coefficient", "alpha1 must be >= 0"),
    ("fit error", "profile.meta.compute.mean_abs_rel_error must be a number"),
    ("source", "wraps the output of flexsp profile"),
    ("not json", "is not valid JSON"),
    ("oversized", "over the 1048576 a preset may have"),
])
def test_malformed_or_foreign_preset_is_refused_by_name(tmp_path, monkeypatch, how, message):
    bad = _bad(_document(), how)
    path = tmp_path / f"{H200}.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(flexsp.CostModelError, match=message) as caught:
        read_preset(path)
    assert str(path) in str(caught.value)
    monkeypatch.setattr(measured_presets, "FOLDER", tmp_path)
    with pytest.raises(flexsp.CostModelError, match=message):
        flexsp.cost_from_preset(H200, num_gpus=8)


def test_wrap_a_profile_for_contribution(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_document()["profile"]))
    out = tmp_path / "h200-mine.json"
    assert measured_presets.main([str(profile), "--name", "h200-mine", "--driver", "580.1", "--command",
                                  "flexsp profile --model llama3-8b", "--note", "cuda=13.0", "-o", str(out)]) == 0
    document = read_preset(out)
    assert document["provenance"] == {"driver": "580.1", "command": "flexsp profile --model llama3-8b", "cuda": "13.0"}
    assert "measured on NVIDIA H200 (driver 580.1" in capsys.readouterr().out
    profile.write_text(json.dumps(dict(_document()["profile"], meta={"source": "analytic"})))
    assert measured_presets.main([str(profile), "--name", "h200-mine", "--driver", "1", "--command", "x",
                                  "-o", str(out)]) == 2
    assert "flexsp profile" in capsys.readouterr().err


def test_simulate_prints_the_measured_provenance(capsys):
    from flexsp.cli import main
    assert main(["simulate", "--model", H200, "--gpus", "8", "--steps", "1", "--batch-size", "8", "--context", "32K",
                 "--strategies", "flexsp,static:8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cost model: h200-llama3-8b, token capacity 16692 per GPU" in out
    assert "measured preset h200-llama3-8b: measured on NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130)" in out
    assert "assumed all-to-all at degrees 2..8" in out


def test_readme_calibration_block_reads_the_preset_and_its_replay(tmp_path, monkeypatch):
    from scripts import experiment
    tables = experiment("readme_tables")
    block = tables.calibration()
    assert "| `h200-llama3-8b` | NVIDIA H200 (driver 580.159.04" in block
    assert "| 1.22% / 2.64% | 3.5% / 4.6% (" in block and "1.473 s vs 1.406 s (-4.6%)" in block
    document = _document()
    document["profile"]["meta"]["compute"]["mean_abs_rel_error"] = 0.05    # the figure follows the file
    (tmp_path / f"{H200}.json").write_text(json.dumps(document))
    monkeypatch.setattr(measured_presets, "FOLDER", tmp_path)
    assert "| 5.00% / 2.64% |" in tables.calibration()


def test_every_preset_file_is_package_data():
    """An installed FlexSP carries the folder: pyproject's package-data covers every preset file."""
    import fnmatch
    from pathlib import Path
    tomllib = pytest.importorskip("tomllib")      # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flexsp"]
    files = [p.relative_to(root / "flexsp").as_posix() for p in FOLDER.glob("*.json")]
    assert files and all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files), (files, patterns)


def _paths(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*path, key))


JUNK = [None, "abc", "5", -1, 0, 1e308, True, [], {}, [1, "x"], {"x": 1}]


def test_any_damaged_field_is_a_named_error_never_a_crash(tmp_path):
    """Every field of the shipped preset replaced by junk, one at a time: loading, building the cost model for a
    setting and describing it either work or raise CostModelError, never another exception."""
    import copy
    import random
    document = _document()
    paths = [p for p in _paths(document) if p]
    rng = random.Random(7)
    for path in rng.sample(paths, 120):
        damaged = copy.deepcopy(document)
        target = damaged
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = rng.choice(JUNK)
        (tmp_path / f"{H200}.json").write_text(json.dumps(damaged))
        try:
            describe_sources(measured_presets.measured_cost_model(H200, num_gpus=64, gpus_per_node=4, folder=tmp_path))
        except flexsp.CostModelError:
            pass


def test_a_measured_dense_preset_costs_the_kv_heads_the_runtime_copies():
    """The shipped Llama-3-8B preset (32 heads, 8 kv heads) moves 1.2x at Ulysses 16 and 1.6x at 32, as the analytic
    model of the same shape does (the profile predates the field: it is derived from the recorded shape)."""
    cost = measured_presets.measured_cost_model("h200-llama3-8b", num_gpus=64)
    analytic = flexsp.cost_from_hardware("llama3-8b", "h100-80gb", 64)
    assert cost.alltoall_replication == pytest.approx(analytic.alltoall_replication) == {16: 1.2, 32: 1.6}
