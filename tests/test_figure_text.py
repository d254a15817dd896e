"""The pictures' text, read back from the figure objects: titles say what and which step, legends never
sit on the data, no tick label is drawn over another and nothing is cut off (issue 38, point 16)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flexsp
from figure_text import legend_texts, legends_over_axes, text_problems
from scripts import EXPERIMENTS, experiment


def rows(name: str) -> list[dict]:
    return experiment("common").read_csv(EXPERIMENTS / "results" / f"{name}.csv")


def test_ablations_figure_labels_its_log_axis_once():
    """The committed ablations.png (linked from the docs) is drawn from this CSV by this function."""
    data = rows("ablations")
    fig = experiment("ablations").figure(data, list(dict.fromkeys(r["dataset"] for r in data)))
    assert text_problems(fig) == []
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["4", "8", "16", "32", "64"]
    assert fig.get_suptitle().startswith("Simulated")


@pytest.mark.parametrize("largest", [64, 1024])
def test_scalability_figure_labels_its_log_axis_once(largest):
    """Within one decade of GPU counts (a quick run) matplotlib would label minor ticks over the major ones."""
    data = [r for r in rows("scalability") if r["num_gpus"] <= largest]
    fig = experiment("scalability").figure(data, "wikipedia", "gpt-7b")
    assert text_problems(fig) == []
    assert "Simulated" in fig.get_suptitle()


def test_e2e_figure_title_gives_the_run_it_shows_and_fits():
    quick = [dict(r, batch_size=64, iterations=1) for r in rows("e2e_speedup")
             if r["model"] == "gpt-7b" and r["context"] == "384K"]
    fig = experiment("e2e_speedup").figure(quick, ["gpt-7b"], [384 * 1024])
    title = fig.get_suptitle()
    assert "batch 64" in title and "batch 512" not in title and "Simulated" in title
    assert text_problems(fig) == [] and legends_over_axes(fig) == []
    assert legend_texts(fig) == ["Megatron (TP8+CP)", "DeepSpeed (static SP)", "BatchAda", "dynamic CP", "FlexSP"]


def _sim(tmp_path):
    from flexsp.evaluation.simulate import simulate
    from flexsp.plan.lengths import get_distribution
    cluster = flexsp.Cluster(16, 8)
    cost = flexsp.cost_from_preset("gpt-7b", context=64 * 1024, num_gpus=16)
    sim = simulate(get_distribution("wikipedia"), cost, cluster, ["flexsp", "batchada"], steps=2, batch_size=48,
                   context=64 * 1024, progress=False)
    return sim, cost


def test_gantt_legend_beside_the_bars_and_title_names_the_step(tmp_path):
    from flexsp.evaluation.plots import gantt_figure, step_times_figure
    sim, cost = _sim(tmp_path)
    plan = sim.runs["flexsp"].first_plan
    fig = gantt_figure(plan, sim.first_batch, cost, step=1)
    title = fig.axes[0].get_title()
    assert "step 1" in title and "Simulated" in title and f"{len(sim.first_batch)} sequences" in title
    assert legends_over_axes(fig) == []
    assert sorted(legend_texts(fig)) == sorted(f"SP degree {d}" for d in plan.degree_histogram())
    assert text_problems(fig) == []
    steps = step_times_figure(sim)
    assert steps.axes[0].get_title().startswith("Simulated") and legends_over_axes(steps) == []
    assert {"lower bound"} <= {t.split(" (")[0] for t in legend_texts(steps)}


def test_pictures_need_a_suffix_and_pdf_takes_the_provenance_without_warning(tmp_path, recwarn):
    from flexsp.errors import FlexSPError
    from flexsp.evaluation.plots import _pyplot, save_with_provenance
    plt = _pyplot()
    with pytest.raises(FlexSPError, match=r"steps: a picture needs one of the suffixes .png, .pdf, .svg"):
        save_with_provenance(plt.figure(), tmp_path / "steps", source="test")
    assert not list(tmp_path.iterdir())                       # nothing written, not steps.png
    for suffix in (".pdf", ".svg", ".png"):
        fig, ax = plt.subplots()
        ax.plot(np.arange(3))
        assert save_with_provenance(fig, tmp_path / f"x{suffix}", source="test").stat().st_size > 500
    assert [str(w.message) for w in recwarn] == []            # PDF: no "Unknown infodict keyword: 'Source'"
    pdf = (tmp_path / "x.pdf").read_bytes()
    assert b"/Creator (flexsp" in pdf and b"/Subject (Source: test" in pdf
