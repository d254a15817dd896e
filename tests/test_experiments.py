"""Every paper-reproduction script runs in --quick mode and writes its table (Markdown + CSV) and figure."""
import csv

import pytest

from scripts import run_script

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
def test_quick_mode_outputs(script, tmp_path, tree_unchanged):
    """Without --out, a quick run writes to a temporary folder ($FLEXSP_QUICK_OUT here), never results/."""
    run_script(script, "--quick", "--quiet", timeout=120, env={"FLEXSP_QUICK_OUT": str(tmp_path)})
    markdown = (tmp_path / f"{script}.md").read_text()
    assert "quick mode" in markdown
    assert "Simulated, not measured" in markdown and "measured max" not in markdown
    assert (tmp_path / f"{script}.png").stat().st_size > 1000
    for name, (columns, min_rows) in EXPECTED[script].items():
        with (tmp_path / name).open() as f:
            rows = list(csv.DictReader(f))
        assert columns <= set(rows[0]), f"{name} lacks {columns - set(rows[0])}"
        assert len(rows) >= min_rows, f"{name} has {len(rows)} rows, expected >= {min_rows}"
    # every output names its distribution, and approximations say so
    if "github" in markdown or "commoncrawl" in markdown:
        assert "approx" in markdown.lower()


# --- values, not only columns -------------------------------------------------------------------------

def _experiment(name):
    from scripts import experiment
    return experiment(name)


def _hand_time(plan, lengths, cost):
    """A plan's step time from the paper's formula written out: per micro-batch the slowest group's
    sum over its sequences of (alpha1 s^2 + alpha2 s)/d + all-to-all bytes/(d * bandwidth[d]), + beta1
    (gpt-7b at 64 GPUs has no ring axis)."""
    step = 0.0
    for mb in plan.micro_batches:
        times = []
        for g in mb.groups:
            s = lengths[list(g.seq_ids)].astype(float)
            comm = 0.0 if g.degree == 1 else cost.comm_bytes_per_token * s.sum() / g.degree / cost.bandwidth(g.degree)
            times.append(((cost.alpha1 * s * s).sum() + cost.alpha2 * s.sum()) / g.degree + comm + cost.beta1)
        step += max(times)
    return step


def test_known_plan_time_recomputed_by_hand():
    import numpy as np

    import flexsp
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    lengths = np.array([200_000, 60_000, 9_000, 4_000, 3_000, 2_500, 1_200, 800] * 4, dtype=np.int64)
    for strategy, degree in (("flexsp", None), ("static", 64), ("batchada", None)):
        plan = flexsp.plan_batch(lengths, cost, flexsp.Cluster(64, 8), strategy, sp_degree=degree, time_limit=0.5)
        assert plan.predicted_time == pytest.approx(_hand_time(plan, lengths, cost), rel=1e-9), strategy


def test_case_study_group_parts_match_the_cost_model():
    import numpy as np

    import flexsp
    case = _experiment("case_study")
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    lengths = np.array([30_000, 5_000, 700])
    for degree in (1, 8, 32):
        compute, comm, fixed = case.group_parts(lengths, degree, cost)
        assert compute + comm + fixed == pytest.approx(cost.group_time(lengths, degree), rel=1e-12)
        assert (comm == 0) == (degree == 1)


def test_speedup_direction_on_constructed_batches():
    """Many short sequences: static SP 64 pays all-to-all on every one, FlexSP runs them at low degrees,
    so FlexSP's simulated speedup over static 64 is > 1; and (candidates include batchada's plan) never < 1."""
    import numpy as np

    import flexsp
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    cluster = flexsp.Cluster(64, 8)
    short = np.full(256, 2_000, dtype=np.int64)

    def time(strategy, degree=None):
        return flexsp.plan_batch(short, cost, cluster, strategy, sp_degree=degree, time_limit=0.5).predicted_time

    fx = time("flexsp")
    assert time("static", 64) / fx > 1.5
    assert time("batchada") / fx >= 1 - 1e-9


def test_case_study_groups_fill_the_cluster(tmp_path):
    """Every micro-batch of the case study's Table 3 uses at most the 64 GPUs, static SP uses exactly its
    degree, and the group counts written out add up (``DxK`` = K groups of degree D)."""
    run_script("case_study", "--quick", "--quiet", "--out", tmp_path, timeout=120)
    with (tmp_path / "case_study_groups.csv").open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        used = sum(int(d) * int(k) for d, k in (part.split("x") for part in row["groups"].split(", ")))
        assert 0 < used <= 64, row
        if row["strategy"] == "DeepSpeed (static SP 64)":
            assert row["groups"] == "64x1"
        if row["strategy"] == "DeepSpeed (static SP 32)":
            assert set(row["groups"].split(", ")) <= {"32x1", "32x2"}
    assert "**Simulated, not measured**" in (tmp_path / "case_study.md").read_text()


def test_quick_run_says_where_it_wrote_and_reuses_one_folder(tmp_path):
    """Without --out or $FLEXSP_QUICK_OUT, quick runs write to one scratch folder per user, reused, and name it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch), "FLEXSP_QUICK_OUT": ""}
    first = run_script("case_study", "--quick", "--quiet", timeout=120, env=env)
    run_script("case_study", "--quick", "--no-progress", timeout=120, env=env)   # the old spelling still works
    folders = list(scratch.iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("flexsp-quick-"), folders
    assert f"outputs in {folders[0]}" in first.stderr
    assert (folders[0] / "case_study.md").is_file()


def test_layer_kinds_quick_compares_each_model_with_its_full_attention_twin(tmp_path):
    run_script("layer_kinds", "--quick", "--quiet", "--out", tmp_path, timeout=120)
    with (tmp_path / "layer_kinds.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["gpt-oss-20b"] * 2 + ["gemma-3-27b"] * 2 + ["qwen3.5-27b"] * 2
    assert {r["costed_as"] for r in rows[1::2]} == {"every layer full attention"}
    assert rows[2]["layers"] == "52 window 1024, 10 full" and rows[4]["layers"] == "48 linear, 16 full"
    # the windowed model is cheaper than its twin under the twin's own prediction
    assert float(rows[2]["mean_step_s"]) < float(rows[3]["mean_step_s"])
    markdown = (tmp_path / "layer_kinds.md").read_text()
    assert "Simulated, not measured" in markdown and "analytic" in markdown
