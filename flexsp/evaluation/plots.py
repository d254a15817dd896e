"""Pictures of simulations and plans (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from flexsp.evaluation.simulate import Simulation
from flexsp.plan.cost import CostModel
from flexsp.plan.types import Plan


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_step_times(sim: Simulation, path: str | Path) -> Path:
    """Simulated step time of every strategy at every step, with the lower bound."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = np.arange(1, sim.steps + 1)
    for name, run in sim.runs.items():
        if not run.error:
            ax.plot(steps, run.step_times, marker="o", ms=3, label=f"{name} ({run.total:.1f} s)")
    ax.plot(steps, sim.lower_bounds, "k--", lw=1, label="lower bound")
    label = " (approximation)" if sim.approximate else ""
    ax.set(xlabel="step", ylabel="simulated step time (s)",
           title=f"{sim.dataset}{label}, {sim.num_gpus} GPUs, context {sim.context // 1024}K, batch {sim.batch_size}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_gantt(plan: Plan, lengths, cost: CostModel, path: str | Path, title: str | None = None) -> Path:
    """One step's layout: ranks on the y axis, time on the x axis, a box per SP group."""
    plt = _pyplot()
    lengths = np.asarray(lengths)
    fig, ax = plt.subplots(figsize=(9, max(3.0, plan.num_gpus * 0.06 + 2)))
    colors = plt.get_cmap("viridis")
    degrees = sorted({g.degree for mb in plan.micro_batches for g in mb.groups})
    shade = {d: colors(i / max(1, len(degrees) - 1)) for i, d in enumerate(degrees)}
    start = 0.0
    for m, mb in enumerate(plan.micro_batches):
        times = [cost.group_time(lengths[list(g.seq_ids)], g.degree) for g in mb.groups]
        for g, t in zip(mb.groups, times):
            ax.add_patch(plt.Rectangle((start, g.ranks[0]), t, g.degree, facecolor=shade[g.degree],
                                       edgecolor="white", lw=0.5))
        start += max(times)
        ax.axvline(start, color="k", lw=0.8, ls=":")
    handles = [plt.Rectangle((0, 0), 1, 1, color=shade[d]) for d in degrees]
    ax.legend(handles, [f"SP degree {d}" for d in degrees], fontsize=7, loc="upper right", ncol=2)
    ax.set(xlim=(0, start * 1.02), ylim=(plan.num_gpus, 0), xlabel="time (s)", ylabel="rank",
           title=title or f"{plan.strategy}: {len(plan.micro_batches)} micro-batches, {plan.predicted_time:.2f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
