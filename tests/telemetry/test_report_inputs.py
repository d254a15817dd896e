"""``flexsp report RUN_DIR`` reads files it did not write: every malformed, oversized or special file in a run
directory is one named ``TelemetryError`` line and exit status 2, never a traceback, a hang or a huge
allocation; a large world is drawn in part, and says so. Torch-free."""
import json
import os
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest
from test_report_text import _record

from flexsp.cli import main
from flexsp.telemetry import records, report
from flexsp.telemetry.records import STEP_FIELDS, TelemetryError, read_records
from flexsp.telemetry.report import gantt_figure, summarize


def _line(**changes) -> str:
    return json.dumps(dict(_record(True, 0), **changes)) + "\n"


def _ranks(edit) -> str:
    """A record whose rank records ``edit`` changed in place."""
    record = _record(True, 0)
    edit(record["ranks"])
    return json.dumps(record) + "\n"


def _groups(edit) -> str:
    record = _record(True, 0)
    edit(record["micro_batches"])
    return json.dumps(record) + "\n"


def _valid() -> str:
    return _line() + json.dumps(_record(False, 1)) + "\n"


def _report(run_dir, capsys, *extra: str) -> str:
    """``flexsp report`` on ``run_dir`` fails with status 2 and one error line, which is returned."""
    assert main(["report", str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexsp report: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


RECORDS = {   # records.jsonl -> what the error says
    "number": ("1\n", "line 1 is a number, not a step record"),
    "null": ("null\n", "line 1 is null, not a step record"),
    "array": ("[1, 2]\n", "line 1 is an array, not a step record"),
    "string": ('"step world"\n', "line 1 is a string"),
    "not utf-8": (b"\xff\xfe\n", "line 1 is not UTF-8"),
    "deep": ("[" * 100_000 + "]" * 100_000 + "\n", "line 1 is nested too deeply"),
    "long integer": ('{"step": 1' + "0" * 5000 + "}\n", "line 1 is not JSON"),
    "key twice": (_line().replace('"seconds": 1.0', '"seconds": 1.0, "seconds": 99.0', 1),
                  "line 1 has the key 'seconds' twice in one object"),
    "seconds string": (_line(seconds="1.0"), "line 1: seconds must be a number, got a string"),
    "seconds NaN": (_line(seconds=float("nan")), "line 1: seconds must be finite"),
    "seconds huge": (_line().replace('"seconds": 1.0', '"seconds": 1' + "0" * 400, 1), "seconds = 1000"),
    "step null": (_line(step=None), "step must be an integer, got null"),
    "step float": (_line(step=1.5), "step must be an integer"),
    "cost version string": (_line(cost_version="a"), "cost_version must be an integer, got a string"),
    "fallback number": (_line(fallback=1), "fallback must be a boolean"),
    "tokens zero": (_line(tokens=0), "tokens must be >= 1"),
    "world negative": (_line(world=-1), "world must be >= 1"),
    "world over the gpus cap": (_line(world=10**9), "over the cap of"),
    "world without its ranks": (_line(world=100_000), "world is 100000 but ranks holds 4 rank records"),
    "mfu without a peak": (_line(mfu=0.5), "mfu is given without peak_flops"),
    "micro-batches a number": (_line(micro_batches=5), "micro_batches must be an array, got a number"),
    "micro-batches empty": (_line(micro_batches=[]), "micro_batches is empty"),
    "micro-batch without groups": (_line(micro_batches=[{"measured": 1.0}]), "micro_batches[0] lacks planned, groups"),
    "micro-batch measured zero": (_groups(lambda mbs: mbs[0].update(measured=0.0)), "micro_batches[0].measured must be > 0"),
    "groups empty": (_groups(lambda mbs: mbs[0].update(groups=[])), "micro_batches[0].groups is empty"),
    "group degree string": (_groups(lambda mbs: mbs[1]["groups"][0].update(degree="4")),
                            "micro_batches[1].groups[0].degree must be an integer"),
    "group rank outside the world": (_groups(lambda mbs: mbs[0]["groups"][0].update(ranks=[0, 7])),
                                     "micro_batches[0].groups[0].ranks must hold ranks 0..3"),
    "group lengths strings": (_groups(lambda mbs: mbs[0]["groups"][0].update(lengths=["a"])), "lengths must hold"),
    "ranks a string": (_line(ranks="x"), "ranks must be an array, got a string"),
    "ranks empty": (_line(ranks=[]), "world is 4 but ranks holds 0"),
    "rank out of order": (_ranks(lambda ranks: ranks[1].update(rank=5)), "ranks[1].rank is 5"),
    "rank missing micro-batches": (_ranks(lambda ranks: ranks[2].update(micro_batches=[])),
                                   "ranks[2].micro_batches holds 0 micro-batches, the step 2"),
    "rank field missing": (_ranks(lambda ranks: ranks[0].pop("seconds")), "ranks[0] lacks seconds"),
    "rank micro-batch not an object": (_ranks(lambda ranks: ranks[0]["micro_batches"].__setitem__(0, 3)),
                                       "ranks[0].micro_batches[0] must be an object"),
    "rank in no group": (_ranks(lambda ranks: ranks[0]["micro_batches"][0].update(group=99)),
                         "ranks[0].micro_batches[0].group is 99 but micro-batch 0 has 2 groups"),
    "start negative": (_ranks(lambda ranks: ranks[3]["micro_batches"][1].update(start=-1.0)),
                       "ranks[3].micro_batches[1].start must be >= 0"),
}


@pytest.mark.parametrize("case", RECORDS)
def test_a_malformed_record_is_one_named_line(case, tmp_path, capsys):
    content, says = RECORDS[case]
    (tmp_path / "records.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TelemetryError, match="line 1"):   # first: before the fix, a world of 10^9 is drawn
        read_records(tmp_path)
    err = _report(tmp_path, capsys)
    assert f"{tmp_path / 'records.jsonl'} line 1" in err and says in err, err
    assert len(err) < 300


SIDE_FILES = {   # (file, content) -> what the error says
    "refits not json": ("refits.jsonl", "not json\n", "refits.jsonl line 1 is not JSON"),
    "refits a number": ("refits.jsonl", "1\n", "refits.jsonl line 1 is not a refit"),
    "refits without a step": ("refits.jsonl", "{}\n", "refits.jsonl line 1 is not a refit"),
    "refits step string": ("refits.jsonl", '{"step": "a"}\n', "refits.jsonl line 1 is not a refit"),
    "refits not utf-8": ("refits.jsonl", b"\xff\n", "refits.jsonl line 1 is not UTF-8"),
    "run.json an array": ("run.json", "[1]", "run.json is an array, not a JSON object"),
    "run.json not utf-8": ("run.json", b"\xff", "run.json is not UTF-8"),
    "run.json not json": ("run.json", "{", "run.json is not valid JSON"),
    "run.json device a number": ("run.json", '{"device": 5}', "device must be a string"),
}


@pytest.mark.parametrize("case", SIDE_FILES)
def test_a_malformed_refits_or_run_file_is_one_named_line(case, tmp_path, capsys):
    name, content, says = SIDE_FILES[case]
    (tmp_path / "records.jsonl").write_text(_valid())
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    assert says in _report(tmp_path, capsys)
    assert not (tmp_path / "report").exists()   # refused before any plot is written


@pytest.mark.parametrize("name", ["records.jsonl", "refits.jsonl", "run.json"])
@pytest.mark.parametrize("special", ["/dev/null", "directory"])
def test_special_files_are_refused_unread(name, special, tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text(_valid())
    path = tmp_path / name
    path.unlink(missing_ok=True)
    if special == "directory":
        path.mkdir()
    else:
        path.symlink_to(special)
    assert "not a regular file" in _report(tmp_path, capsys)


@pytest.mark.parametrize("name", ["records.jsonl", "run.json"])
def test_a_fifo_is_refused_not_waited_on(name, tmp_path):
    (tmp_path / "records.jsonl").write_text(_valid())
    path = tmp_path / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    done = subprocess.run([sys.executable, "-m", "flexsp", "report", str(tmp_path)], capture_output=True, text=True,
                          timeout=30, env=dict(os.environ, MPLBACKEND="Agg"))
    assert done.returncode == 2 and "not a regular file" in done.stderr and "Traceback" not in done.stderr


def test_a_line_or_file_over_its_cap_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "records.jsonl").write_text(_valid())
    monkeypatch.setenv("FLEXSP_MAX_TEXT_BYTES", "4K")              # the file: two ~3 KB records
    assert "records.jsonl is longer than the cap of 4096 bytes" in _report(tmp_path, capsys)
    assert "--max-input text_bytes=N" in _report(tmp_path, capsys)
    monkeypatch.delenv("FLEXSP_MAX_TEXT_BYTES")
    monkeypatch.setenv("FLEXSP_MAX_JSON_BYTES", "1K")              # a line
    assert "records.jsonl line 1 is longer than the cap of 1024 bytes" in _report(tmp_path, capsys)
    monkeypatch.delenv("FLEXSP_MAX_JSON_BYTES")
    (tmp_path / "records.jsonl").write_text('{"x": "' + "a" * 5000 + '"}\n' + _valid())
    monkeypatch.setenv("FLEXSP_MAX_JSON_BYTES", "4K")              # read no further than the cap
    assert "line 1 is longer than the cap of 4096 bytes" in _report(tmp_path, capsys)


def test_every_field_has_a_kind():
    assert list(records.STEP_KINDS) == list(STEP_FIELDS)


def test_valid_records_still_read_and_a_cut_last_line_is_dropped(tmp_path):
    (tmp_path / "records.jsonl").write_text(_valid() + _line()[:100])   # a run killed mid-write
    assert [r["step"] for r in read_records(tmp_path)] == [0, 1]


def test_gantt_of_a_large_world_draws_at_most_gantt_max_ranks_and_says_so():
    GANTT_MAX = report.GANTT_MAX
    record = _record(True, 0)
    record["ranks"] = [dict(record["ranks"][0], rank=i) for i in range(GANTT_MAX + 36)]
    record["world"] = len(record["ranks"])
    fig = gantt_figure(record)
    ax = fig.axes[0]
    assert f"ranks 0-{GANTT_MAX - 1} of {GANTT_MAX + 36}" in ax.get_title()
    assert len(ax.get_yticks()) == GANTT_MAX and fig.get_size_inches()[1] < 0.6 * GANTT_MAX + 2
    plt.close(fig)


def test_gantt_of_many_micro_batches_draws_at_most_gantt_max_unlabelled():
    GANTT_MAX = report.GANTT_MAX
    record = _record(True, 0)
    mb, rank_mb = record["micro_batches"][1], record["ranks"][0]["micro_batches"][1]
    record["micro_batches"] = [mb] * (GANTT_MAX + 6)
    for rank in record["ranks"]:
        rank["micro_batches"] = [rank_mb] * (GANTT_MAX + 6)
    fig = gantt_figure(record)
    ax = fig.axes[0]
    assert f"micro-batches 0-{GANTT_MAX - 1} of {GANTT_MAX + 6}" in ax.get_title()
    assert len(ax.texts) == 0
    plt.close(fig)


def test_summary_without_measured_groups_or_with_a_late_peak():
    steps = [_record(True, 0), _record(False, 1, peak=1e12)]
    for mb in steps[0]["micro_batches"] + steps[1]["micro_batches"]:
        for group in mb["groups"]:
            group["measured"] = 0.0
    rows = dict(summarize(steps))
    assert rows["median |group error|, first step"].startswith("n/a")
    assert "of 1e+12 FLOP/s" in rows["MFU"]


def test_the_report_never_writes_through_a_symlink_in_the_run_directory(tmp_path, capsys):
    """A run directory is untrusted: a plot path or the report folder linked elsewhere would have the plots
    overwrite the link's target. A linked plot is replaced; a linked folder is refused."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text(_valid())
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (run / "report").mkdir()
    (run / "report" / report.PLOTS[0]).symlink_to(victim)
    assert main(["report", str(run)]) == 0
    assert victim.read_text() == "the user's file"
    plot = run / "report" / report.PLOTS[0]
    assert not plot.is_symlink() and plot.read_bytes().startswith(b"\x89PNG")
    umask = os.umask(0)
    os.umask(umask)
    assert plot.stat().st_mode & 0o777 == 0o666 & ~umask          # as readable as any file the user writes
    assert sorted(p.name for p in (run / "report").iterdir()) == sorted(report.PLOTS)   # no temporary left
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "records.jsonl").write_text(_valid())
    (linked / "report").symlink_to(elsewhere)
    assert "is a symlink; refusing to write the report through it" in _report(linked, capsys)
    assert not any(elsewhere.iterdir())
