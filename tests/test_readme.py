"""The generated blocks of README.md and docs/*.md equal what their owning commands print today."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "experiments" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_tables"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_are_current():
    tables = _readme_tables()
    for page in tables.documents():
        _, changed = tables.update(page.read_text())
        assert not changed, f"{page.name} blocks {changed} differ from their commands: run python experiments/readme_tables.py"


def test_check_catches_a_stale_table():
    tables = _readme_tables()
    text = (ROOT / "README.md").read_text()
    assert "<!-- generated: simulate -->" in text
    stale = text.replace("| flexsp | ", "| flexsp | 1", 1)   # a figure that no longer matches
    _, changed = tables.update(stale)
    assert changed == ["simulate"]


def test_timing_column_is_ignored():
    tables = _readme_tables()
    row = "| flexsp | 39.14 | 3.914 | 0.708 / 0.966 |"
    assert tables.without_timings(row) == tables.without_timings(row.replace("0.708", "0.901"))
    assert tables.without_timings(row) != tables.without_timings(row.replace("39.14", "39.15"))


def test_searched_row_tolerates_load_but_not_a_real_change():
    tables = _readme_tables()
    block = ("```\nx\n| strategy | total time (s) | flexsp speedup | groups | solve mean / max (s) |\n|---|---|---|---|---|\n"
             "| flexsp | 39.00 | 1.00x | 1x608 | 0.9 |\n| batchada | 48.62 | 1.25x | 8x112 | 0.01 |\n```\n")
    drift = block.replace("39.00", "39.14").replace("1x608", "1x589").replace("1.25x", "1.24x")
    assert not tables.simulation_differs(drift, block)
    assert tables.simulation_differs(block.replace("39.00", "40.00"), block)      # flexsp 2.5% off
    assert tables.simulation_differs(block.replace("48.62", "48.63"), block)      # a deterministic row
    assert tables.simulation_differs(block.replace("\nx\n", "\ny\n"), block)      # the header line
