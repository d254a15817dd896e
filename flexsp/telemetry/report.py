"""``flexsp report RUN_DIR``: what a run's step records say, as a table and four plots. Torch-free.

Plots (matplotlib, Agg): planned vs measured time per step; the Gantt of one step as it really ran
(per rank: each micro-batch's forward and backward, micro-batches it sat out in grey); idle and
loader-wait fractions (and MFU where a peak FLOP/s is known) over steps; the cost model's group-time
error per step, with the refits. Titles and legends name only what is drawn.

The cost model predicts each group's compute, so "planned / measured" compares that with whole
micro-batches; the table splits a loop iteration into what the model covers (the slowest group's
compute) and what it leaves out (waits beyond it inside micro-batches, the executor's checks and the
optimizer step, the loader), so a small ratio beside a small group error explains itself.

A run directory is untrusted input: ``records.py`` reads its files within ``flexsp.inputs``' caps and checks
every field, so a bad file is one ``TelemetryError`` line naming the file, line and field.
"""
from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flexsp.telemetry.records import TelemetryError, group_errors, read_records, read_refits, read_run

PLOTS = ("step_times.png", "gantt.png", "fractions.png", "cost_error.png")
GANTT_MAX = 64      # ranks and micro-batches the Gantt draws at most: more are unreadable, and slow to draw
GANTT_LABELS = 16   # micro-batches per step up to which each bar is labelled (more overlap, and cost seconds)


def summarize(records: Sequence[dict[str, Any]], refits: Sequence[dict[str, Any]] = ()) -> list[tuple[str, str]]:
    """(figure, value) rows of the summary table."""
    col = lambda key: np.asarray([r[key] for r in records if r[key] is not None], dtype=np.float64)  # noqa: E731
    measured = np.asarray([sum(mb["measured"] for mb in r["micro_batches"]) for r in records])
    planned = col("planned_seconds")
    errors = [median_error(r) for r in records]
    versions = [r["cost_version"] for r in records]
    first_refit = next((i for i, v in enumerate(versions) if v > versions[0]), None)
    mfu = col("mfu")
    peak = next((r["peak_flops"] for r in records if r["mfu"] is not None), None)
    memory = col("peak_memory_bytes")
    rows = [
        ("steps", f"{len(records)} (world {records[0]['world']}, strategy {records[0]['strategy']})"),
        ("step time, measured (mean / median)", f"{col('seconds').mean():.4g} s / {np.median(col('seconds')):.4g} s"),
        ("micro-batches: planned / measured (median per step; what differs: the split below)",
         f"{np.median(planned / measured):.3f}"),
        ("tokens/s (loader wait included)", f"{col('tokens_per_s').mean():,.0f}"),
        ("supervised tokens (loss targets) / tokens", supervised(records)),
        ("MFU", "n/a (no peak FLOP/s: give peak_flops)" if not len(mfu) else
         f"{mfu.mean():.2%} of {peak:.3g} FLOP/s per device"),
        ("idle in collectives / sat out (mean fraction of step)", f"{col('idle_fraction').mean():.1%}"),
        ("waiting for the loader (mean fraction of loop)", f"{col('loader_fraction').mean():.1%}"),
        ("fallback plans", f"{sum(bool(r['fallback']) for r in records)} of {len(records)}"),
        ("cost-model refits", f"{len(refits)} (model version {versions[0]} -> {versions[-1]})"),
        ("median |group error|, first step", _percent(errors[:1])),
    ]
    if first_refit is not None:
        rows += [("median |group error|, before first refit", _percent(errors[:first_refit])),
                 ("median |group error|, after first refit", _percent(errors[first_refit:]))]
    else:
        rows.append(("median |group error|, all steps", _percent(errors)))
    rows += split(records)
    rows += [("peak memory", "n/a" if not len(memory) else
              f"{memory.max() / 2**20:,.0f} MiB ({records[0]['memory_kind']})"),
             ("most tokens per GPU / token capacity",
              f"{max(r['max_tokens_per_gpu'] for r in records):.0f} / {records[0]['token_capacity']:.0f}"),
             ("telemetry time on the training thread (max rank, mean per step)",
              f"{col('probe_seconds').mean() * 1e3:.3f} ms ({(col('probe_seconds') / col('seconds')).mean():.3%})")]
    return rows


def median_error(record: dict[str, Any]) -> float:
    """The median |group error| of a step; NaN where no group has a measured time (nothing to compare)."""
    errors = np.abs(group_errors(record))
    return float(np.median(errors)) if errors.size else float("nan")


def _percent(errors: Sequence[float]) -> str:
    known = [e for e in errors if not np.isnan(e)]
    return f"{np.median(known):.1%}" if known else "n/a (no group with a measured time)"


def supervised(records: Sequence[dict[str, Any]]) -> str:
    """The run's loss targets beside its tokens: a step's loss is per supervised token, tokens/s counts all."""
    known = [r for r in records if r.get("supervised_tokens") is not None]
    if not known:
        return "n/a (records without supervised_tokens)"
    sup, tokens = sum(r["supervised_tokens"] for r in known), sum(r["tokens"] for r in known)
    return f"{sup:,} / {tokens:,} ({sup / tokens:.1%}" + (f"; {len(known)} of {len(records)} steps)"
                                                          if len(known) < len(records) else ")")


def split(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Rows splitting the mean loop iteration (step + loader) into what the cost model predicts and what it
    leaves out; the four parts add up to the loop time."""
    loop = np.mean([r["loop_seconds"] for r in records])
    compute = np.mean([sum(max(g["measured"] for g in mb["groups"]) for mb in r["micro_batches"]) for r in records])
    walls = np.mean([sum(mb["measured"] for mb in r["micro_batches"]) for r in records])
    step = np.mean([r["seconds"] for r in records])
    planned = np.mean([r["planned_seconds"] for r in records])
    share = lambda x: f"{x:.4g} s ({x / loop:.0%})"   # noqa: E731
    return [("loop time per step (mean), split into:", f"{loop:.4g} s"),
            (f"  slowest group's compute per micro-batch (the cost model predicts {planned:.4g} s of it)",
             share(compute)),
            ("  not in the cost model: micro-batch wall beyond that (collectives, idle ranks, waiting for a core)",
             share(walls - compute)),
            ("  not in the cost model: executor checks and the optimizer step", share(step - walls)),
            ("  not in the cost model: waiting for the loader (plan, fetch, pack)", share(loop - step))]


def format_table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_report(run_dir: str | Path, *, step: int | None = None, out: str | Path | None = None) -> tuple[str, list[Path]]:
    """The summary table and the plot files (in ``out``, default ``RUN_DIR/report``)."""
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    refits = read_refits(run_dir)
    steps = [r["step"] for r in records]
    if step is None:
        chosen = records[-1]
    elif step in steps:
        chosen = records[steps.index(step)]
    else:
        raise TelemetryError(f"--step {step} is not in {run_dir} (steps {steps[0]}..{steps[-1]})")
    if out is None:
        out = run_dir / "report"
        if out.is_symlink():   # the run directory is untrusted: a link there must not send the plots elsewhere
            raise TelemetryError(f"{out} is a symlink; refusing to write the report through it (pass --out DIR)")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TelemetryError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    paths = [out / name for name in PLOTS]

    for figure, path in zip((times_figure(records), gantt_figure(chosen), fractions_figure(records),
                             error_figure(records, refits)), paths):
        _save(figure, path)
    return format_table(summarize(records, refits)), paths


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _per_step(ax) -> None:
    """Steps are whole numbers: no 2.5 on a per-step axis."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def times_figure(records: Sequence[dict[str, Any]]):
    """Planned vs measured time per step (returned open; the figures below too)."""
    fig, ax = _pyplot().subplots(figsize=(8, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["planned_seconds"] for r in records], "o-", label="planned (micro-batches, cost model)")
    ax.plot(steps, [sum(mb["measured"] for mb in r["micro_batches"]) for r in records], "s-",
            label="measured (micro-batches)")
    ax.plot(steps, [r["seconds"] for r in records], "--", label="measured step (checks + optimizer included)")
    ax.set(xlabel="step", ylabel="seconds", title="planned vs measured time per step")
    _per_step(ax)
    ax.legend()
    return fig


def gantt_figure(chosen: dict[str, Any]):
    """One step as it ran; the title mentions grey only when a rank sat a micro-batch out. At most the first
    ``GANTT_MAX`` ranks and micro-batches are drawn (the title says so), labelled up to ``GANTT_LABELS``
    micro-batches: a record of a large world would otherwise make a figure too tall to read, and minutes and
    gigabytes to draw."""
    plt = _pyplot()
    ranks = chosen["ranks"][:GANTT_MAX]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(ranks) + 1.6))
    colors = plt.get_cmap("tab10")
    out, ran = [], []   # (rank, micro-batch index, its record): sat out, run
    for rank in ranks:
        for m, mb in enumerate(rank["micro_batches"][:GANTT_MAX]):
            (out if mb["group"] is None else ran).append((rank["rank"], m, mb))
    sat_out = bool(out)
    _bars(ax, out, "start", "end", facecolors="lightgrey", edgecolors="grey")
    _bars(ax, ran, "start", "forward", facecolors=[colors(m % 10) for _, m, _ in ran], alpha=0.9)
    _bars(ax, ran, "forward", "end", facecolors=[colors(m % 10) for _, m, _ in ran], alpha=0.5, hatch="//")
    ax.autoscale_view()
    labelled = ran if len(chosen["micro_batches"]) <= GANTT_LABELS else []
    for y, m, mb in labelled:
        degree = chosen["micro_batches"][m]["groups"][mb["group"]]["degree"]
        ax.text((mb["start"] + mb["end"]) / 2, y, f"mb{m} d{degree}", ha="center", va="center", fontsize=7)
    key = "solid: forward, hatched: backward" + (", grey: sat out" if sat_out else "")
    shown = [f"{what} 0-{GANTT_MAX - 1} of {n}" for what, n in (("ranks", len(chosen["ranks"])),
             ("micro-batches", len(chosen["micro_batches"]))) if n > GANTT_MAX]
    ax.set(xlabel="seconds since the step's agreement", ylabel="rank", yticks=range(len(ranks)),
           title=f"step {chosen['step']} as it ran ({key}); planned {chosen['planned_seconds']:.3g} s"
           + (f"\nshown: {', '.join(shown)}" if shown else ""))
    ax.invert_yaxis()
    return fig


def _bars(ax, cells: Sequence[tuple[int, int, dict[str, Any]]], start: str, end: str, **style: Any) -> None:
    """Bars of height 0.8 from ``mb[start]`` to ``mb[end]`` at each cell's rank, as one collection: one
    ``barh`` artist per bar costs milliseconds each, minutes for a large Gantt."""
    from matplotlib.collections import PolyCollection
    boxes = [[(mb[start], y - 0.4), (mb[end], y - 0.4), (mb[end], y + 0.4), (mb[start], y + 0.4)] for y, _, mb in cells]
    ax.add_collection(PolyCollection(boxes, **style))


def fractions_figure(records: Sequence[dict[str, Any]]):
    """Idle and loader-wait fractions per step, and MFU where it was measured (named in the title only then)."""
    fig, ax = _pyplot().subplots(figsize=(8, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["idle_fraction"] for r in records], label="idle (collectives, sat out)")
    ax.plot(steps, [r["loader_fraction"] for r in records], label="waiting for the loader")
    mfu = any(r["mfu"] is not None for r in records)
    if mfu:
        ax.plot(steps, [r["mfu"] if r["mfu"] is not None else np.nan for r in records], label="MFU")
    ax.set(xlabel="step", ylabel="fraction", ylim=(0, 1),
           title="idle, loader wait and MFU per step" if mfu else
           "idle and loader wait per step (no MFU: no peak FLOP/s for this device)")
    _per_step(ax)
    ax.legend()
    return fig


def error_figure(records: Sequence[dict[str, Any]], refits: Sequence[dict[str, Any]]):
    """The cost model's median group error per step; refits as grey lines, named only when there are some."""
    fig, ax = _pyplot().subplots(figsize=(8, 4))
    steps = [r["step"] for r in records]
    ax.semilogy(steps, [max(median_error(r), 1e-4) for r in records], "o-",
                label="median |planned - measured| / measured, groups")
    for f in refits:
        ax.axvline(f["step"] + 0.5, color="grey", alpha=0.4)
    ax.set(xlabel="step", ylabel="relative error",
           title="cost-model error per step" + (" (grey: refits)" if refits else ""))
    _per_step(ax)
    ax.legend()
    return fig


def _save(fig, path: Path) -> None:
    """Write ``fig`` as ``path`` through a new file renamed over it: a symlink (or anything else) already at
    ``path`` in an untrusted run directory is replaced, never written through."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    tmp = None
    try:
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.png"
        # a new file (O_EXCL: never an existing one or a link), readable as the user's umask says, as savefig's were
        handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(handle, "wb") as f:
            fig.savefig(f, dpi=110, format="png")
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise TelemetryError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# --- command line ------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="summarise a training run's step records and plot them")
    parser.add_argument("run_dir", type=Path, help="the run directory flexsp.telemetry.Telemetry wrote")
    parser.add_argument("--step", type=int, default=None, help="the step drawn as a Gantt chart (default: the last)")
    parser.add_argument("--out", type=Path, default=None, help="where the plots go (default RUN_DIR/report)")


def run(args: argparse.Namespace) -> int:
    described = read_run(args.run_dir)   # before the plots are written: a broken run.json is an error, not a "?"
    table, paths = write_report(args.run_dir, step=args.step, out=args.out)
    print(f"run {args.run_dir}: device {described.get('device', '?')}")
    print(table)
    for path in paths:
        print(f"wrote {path}")
    return 0
