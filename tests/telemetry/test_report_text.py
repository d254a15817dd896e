"""``flexsp report`` says what it shows: the table splits a loop iteration into what the cost model predicts
and what it leaves out, and titles and legends name only what is drawn (issue 38, point 15). Torch-free:
records are built from plain numbers with ``build_record``."""
import re

import pytest

from flexsp import CostModel, Group, MicroBatch, Plan
from flexsp.telemetry.records import build_record
from flexsp.telemetry.report import error_figure, fractions_figure, gantt_figure, summarize, times_figure

COST = CostModel(alpha1=1e-9, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1024.0,
                 alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=4096)
LENGTHS = [300, 200, 400, 900]


def _record(sit_out: bool, step: int = 0, peak: float | None = None) -> dict:
    last = (2,) if sit_out else (2, 3)                                       # rank 3 sits micro-batch 0 out
    first = (Group(ranks=(0, 1), seq_ids=(0, 1)), Group(ranks=last, seq_ids=(2,)))
    plan = Plan(num_gpus=4, predicted_time=0.5, strategy="flexsp", micro_batches=(
        MicroBatch(first), MicroBatch((Group(ranks=(0, 1, 2, 3), seq_ids=(3,)),))))
    ranks = []
    for r in range(4):
        g0 = plan.micro_batches[0].group_of_rank(r)
        mbs = [{"start": 0.0, "forward": 0.1, "end": 0.3, "busy": 0.05 if g0 is not None else None,
                "group": None if g0 is None else plan.micro_batches[0].groups.index(g0), "tokens": 100},
               {"start": 0.3, "forward": 0.45, "end": 0.7, "busy": 0.08, "group": 0, "tokens": 225}]
        ranks.append({"rank": r, "seconds": 1.0, "check_seconds": 0.05, "tail_seconds": 0.25, "plan_wait": 0.1,
                      "load_seconds": 0.05, "idle_seconds": 0.3 if g0 is None else 0.1, "peak_memory_bytes": None,
                      "probe_seconds": 1e-3, "micro_batches": mbs})
    from flexsp.plan.specs import ModelSpec
    spec = ModelSpec(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, tie_embeddings=True)
    return build_record(plan, LENGTHS, ranks, COST, meta={"step": step}, spec=spec, peak=peak)


def _value(rows, start: str) -> float:
    return float(re.match(r"[\d.]+", next(v for k, v in rows if k.lstrip().startswith(start))).group())


def test_the_table_says_what_the_cost_model_leaves_out():
    records = [_record(True, 0), _record(False, 1)]
    rows = summarize(records)
    labels = [k for k, _ in rows]
    assert any("optimizer step" in k and "not in the cost model" in k for k in labels)
    assert any("loader" in k and "not in the cost model" in k for k in labels)
    parts = [_value(rows, p) for p in ("slowest group's compute", "not in the cost model: micro-batch wall",
                                       "not in the cost model: executor checks", "not in the cost model: waiting")]
    assert sum(parts) == pytest.approx(_value(rows, "loop time per step"))
    assert _value(rows, "loop time per step") == pytest.approx(1.15)          # 1.0 step + 0.1 plan wait + 0.05 load
    assert parts[2] == pytest.approx(0.3) and parts[3] == pytest.approx(0.15)  # checks + tail; the loader


def test_titles_and_legends_name_only_what_is_drawn():
    cpu = [_record(True, 0), _record(False, 1)]
    title = fractions_figure(cpu).axes[0].get_title()
    assert "MFU" not in title.replace("no MFU", "")
    assert "MFU" not in [t.get_text() for t in fractions_figure(cpu).axes[0].get_legend().get_texts()]
    gpu = [_record(False, 0, peak=1e12)]
    assert "and MFU" in fractions_figure(gpu).axes[0].get_title()
    assert "grey: sat out" in gantt_figure(cpu[0]).axes[0].get_title()        # rank 3 sits micro-batch 0 out
    assert "grey" not in gantt_figure(cpu[1]).axes[0].get_title()             # nobody does
    assert "refits" not in error_figure(cpu, []).axes[0].get_title()
    assert "grey: refits" in error_figure(cpu, [{"step": 0}]).axes[0].get_title()
    assert "planned" in times_figure(cpu).axes[0].get_title()
