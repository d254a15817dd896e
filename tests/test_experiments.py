"""Every paper-reproduction script runs in --quick mode and writes its table (Markdown + CSV) and figure."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> {csv file: (required columns, minimum rows)}
EXPECTED = {
    "e2e_speedup": {"e2e_speedup.csv": ({"model", "context", "dataset", "approximate", "speedup_megatron",
                                         "speedup_deepspeed", "speedup_batchada", "speedup_dynamic_cp"}, 3)},
    "bucketing_error": {"bucketing_error.csv": ({"dataset", "definition", "buckets", "dp_error_pct",
                                                 "naive_error_pct", "paper_dp_pct", "paper_naive_pct"}, 3 * 8)},
    "case_study": {"case_study.csv": ({"strategy", "step_time_s", "a2a_share_critical", "a2a_share_gpu_time"}, 5),
                   "case_study_groups.csv": ({"strategy", "micro_batch", "groups"}, 5)},
    "scalability": {"scalability.csv": ({"sweep", "num_gpus", "context", "speedup_deepspeed",
                                         "flexsp_solve_mean_s"}, 5)},
    "ablations": {"ablations.csv": ({"variant", "pipeline", "num_buckets", "plan_over_lower_bound",
                                     "solve_mean_s"}, 10)},
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_quick_mode_outputs(script, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / f"{script}.py"), "--quick", "--no-progress",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    markdown = (tmp_path / f"{script}.md").read_text()
    assert "quick mode" in markdown
    assert (tmp_path / f"{script}.png").stat().st_size > 1000
    for name, (columns, min_rows) in EXPECTED[script].items():
        with (tmp_path / name).open() as f:
            rows = list(csv.DictReader(f))
        assert columns <= set(rows[0]), f"{name} lacks {columns - set(rows[0])}"
        assert len(rows) >= min_rows, f"{name} has {len(rows)} rows, expected >= {min_rows}"
    # every output names its distribution, and approximations say so
    if "github" in markdown or "commoncrawl" in markdown:
        assert "approx" in markdown.lower()
