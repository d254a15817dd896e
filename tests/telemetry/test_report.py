"""``flexsp report`` on what is not a run directory: one named error line, exit 2, never a traceback."""
from flexsp.cli import main


def test_report_names_a_missing_or_broken_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no records.jsonl" in capsys.readouterr().err
    (tmp_path / "records.jsonl").write_text('{"step": 0}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "line 1 lacks" in capsys.readouterr().err
    (tmp_path / "records.jsonl").write_text("not json\n{}\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


def test_report_is_torch_free():
    import subprocess
    import sys
    code = ("import sys, flexsp.telemetry.report, flexsp.telemetry.refit, flexsp.telemetry.records, flexsp.cli\n"
            "assert 'torch' not in sys.modules, 'the report imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
