"""Pictures of simulations and plans (matplotlib, headless), each saved with its provenance.

Every PNG records in its text chunks the program that drew it (``Source``) and a SHA-256 of what it
plotted: a data file (``Data``, ``Data-SHA256``) or, for a plan, the plan itself (``Plan-SHA256``). A
test regenerates or re-reads that input and fails when an image in the docs is stale.
"""
from __future__ import annotations

import hashlib
import json
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


def plan_digest(plan: Plan, lengths) -> str:
    """SHA-256 of what a Gantt chart shows: the groups, sequence lengths and predicted time (not the
    solve time, which varies run to run)."""
    data = {"micro_batches": plan.to_dict()["micro_batches"], "predicted_time": round(plan.predicted_time, 9),
            "lengths": [int(n) for n in np.asarray(lengths)]}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


FORMATS = (".png", ".pdf", ".svg")   # what save_with_provenance writes, each with its provenance


def figure_path(path: str | Path, what: str = "") -> Path:
    """``path`` checked to name a picture: a ``.png``/``.pdf``/``.svg`` suffix, else a ``ValueError`` (of the
    ``FlexSPError`` family) saying so, after ``what`` (the flag that gave it): matplotlib would add ``.png``
    itself and write, perhaps over, a file other than the one named."""
    from flexsp.errors import FlexSPError
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise FlexSPError(f"{what + ' ' if what else ''}{path}: a picture needs one of the suffixes "
                          f"{', '.join(FORMATS)}, e.g. {path.with_suffix('.png').name}")
    return path


def _metadata(suffix: str, meta: dict[str, str]) -> dict[str, str]:
    """The provenance in the keys each format takes: PNG text chunks as they are; PDF's info dictionary and
    SVG's metadata have fixed keys, so the record goes into Creator plus Subject (PDF) / Description (SVG)."""
    if suffix == ".png":
        return meta
    record = "; ".join(f"{k}: {v}" for k, v in meta.items() if k != "Software")
    return {"Creator": f"flexsp ({meta['Source']})", ("Subject" if suffix == ".pdf" else "Description"): record}


def save_with_provenance(fig, path: str | Path, *, source: str, data: str | Path | None = None,
                         extra: dict[str, str] | None = None) -> Path:
    """``fig.savefig`` with ``Source`` (the script or command) and, for a data file, its path and SHA-256
    (PNG text chunks; in a PDF or SVG, their metadata fields). ``path`` must end in ``.png``, ``.pdf`` or
    ``.svg`` (``figure_path``); returns it."""
    path = figure_path(path)
    meta = {"Software": "flexsp", "Source": source, **(extra or {})}
    if data is not None:
        data = Path(data)
        meta["Data"] = data.name
        meta["Data-SHA256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    fig.savefig(path, dpi=120, metadata=_metadata(path.suffix.lower(), meta))
    _pyplot().close(fig)
    return path


def png_provenance(path: str | Path) -> dict[str, str]:
    """The text chunks of a PNG written by ``save_with_provenance``."""
    from PIL import Image
    with Image.open(path) as image:
        return dict(image.text)


def step_times_figure(sim: Simulation):
    """The figure of ``plot_step_times`` (returned open, for tests to read its text)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    steps = np.arange(1, sim.steps + 1)
    for name, run in sim.runs.items():
        if not run.error:
            ax.plot(steps, run.step_times, marker="o", ms=3, label=f"{name} ({run.total:.1f} s)")
    ax.plot(steps, sim.lower_bounds, "k--", lw=1, label="lower bound")
    label = " (approximation)" if sim.approximate else ""
    ax.set(xlabel="step", ylabel="simulated step time (s)",
           title=f"Simulated: {sim.dataset}{label}, {sim.num_gpus} GPUs, context {sim.context // 1024}K, "
                 f"batch {sim.batch_size}")
    ax.set_ylim(bottom=0)
    fig.legend(fontsize=8, loc="outside right upper")
    return fig


def plot_step_times(sim: Simulation, path: str | Path) -> Path:
    """Simulated step time of every strategy at every step, with the lower bound."""
    return save_with_provenance(step_times_figure(sim), path, source="flexsp simulate --plot")


def gantt_figure(plan: Plan, lengths, cost: CostModel, title: str | None = None, step: int | None = None):
    """The figure of ``plot_gantt`` (returned open). The legend sits beside the chart, never on its bars;
    the title names the step (``step``, counted from 1) when given."""
    plt = _pyplot()
    lengths = np.asarray(lengths)
    fig, ax = plt.subplots(figsize=(10, max(3.0, plan.num_gpus * 0.06 + 2)), layout="constrained")
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
    fig.legend(handles, [f"SP degree {d}" for d in degrees], fontsize=7, loc="outside right upper")
    which = f"step {step}, " if step is not None else ""
    model = cost.meta.get("preset") or cost.meta.get("source") or "custom"
    ax.set(xlim=(0, start * 1.02), ylim=(plan.num_gpus, 0), xlabel="predicted time (s)", ylabel="rank",
           title=title or f"Simulated {plan.strategy} plan, {which}{len(lengths)} sequences: "
                          f"{len(plan.micro_batches)} micro-batch{'es' * (len(plan.micro_batches) != 1)}, "
                          f"{plan.predicted_time:.2f} s\n{plan.num_gpus} GPUs, cost model: {model}")
    return fig


def plot_gantt(plan: Plan, lengths, cost: CostModel, path: str | Path, title: str | None = None,
               source: str = "flexsp simulate --gantt", step: int | None = None) -> Path:
    """One step's layout: ranks on the y axis, time on the x axis, a box per SP group."""
    return save_with_provenance(gantt_figure(plan, lengths, cost, title, step), path, source=source,
                                extra={"Plan-SHA256": plan_digest(plan, lengths)})
