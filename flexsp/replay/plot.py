"""Gantt chart of a replay: the cost model's prediction above, measured compute + modelled
communication below, on one time axis (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

from flexsp.evaluation.plots import save_with_provenance
from flexsp.replay.report import ReplayReport


def plot_replay_gantt(report: ReplayReport, path: str | Path, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degrees = sorted({g.degree for g in report.groups})
    cmap = plt.get_cmap("viridis")
    shade = {d: cmap(i / max(1, len(degrees) - 1)) for i, d in enumerate(degrees)}
    height = max(2.0, report.num_gpus * 0.05 + 1.4)
    fig, axes = plt.subplots(2, 1, figsize=(9, 2 * height + 0.8), sharex=True)
    rows = (("predicted (cost model; comm hatched)", [(g.predicted_compute, g.comm) for g in report.groups],
             report.micro_batch_predicted),
            ("replayed: measured compute + modelled comm (hatched)", [(g.compute, g.comm) for g in report.groups],
             report.micro_batch_replayed))
    end = max(report.predicted_time, report.replayed_time)
    for ax, (name, spans, makespans) in zip(axes, rows):
        start, m_start = 0.0, {}
        for m, span in enumerate(makespans):
            m_start[m] = start
            start += span
            ax.axvline(start, color="k", lw=0.8, ls=":")
        for g, (compute, comm) in zip(report.groups, spans):
            x = m_start[g.micro_batch]
            ax.add_patch(plt.Rectangle((x, g.first_rank), compute, g.degree, facecolor=shade[g.degree],
                                       edgecolor="white", lw=0.5))
            if comm > 0:
                ax.add_patch(plt.Rectangle((x + compute, g.first_rank), comm, g.degree, facecolor=shade[g.degree],
                                           edgecolor="white", lw=0.5, hatch="///", alpha=0.6))
        ax.set(ylim=(report.num_gpus, 0), ylabel="rank", title=f"{name}: step {start:.4g} s")
    handles = [plt.Rectangle((0, 0), 1, 1, color=shade[d]) for d in degrees]
    axes[0].legend(handles, [f"SP degree {d}" for d in degrees], fontsize=7, loc="upper right", ncol=2)
    axes[1].set(xlim=(0, end * 1.02), xlabel="time (s)")
    label = report.meta.get("label", "")
    fig.suptitle(title or f"{report.strategy or 'plan'} replayed on one device", fontsize=11)
    if label:
        fig.text(0.01, 0.005, label, fontsize=6.5)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return save_with_provenance(fig, path, source="flexsp replay")
