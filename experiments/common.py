"""Shared helpers for the paper-reproduction scripts: arguments, batches, tables, figures.

Every script samples global batches the way ``flexsp.evaluation.simulate`` does (lengths above the context
limit are not drawn, the rest padded to a multiple of 2 x N), so their numbers are comparable, and
every output names the length distribution it used and whether it is an approximation.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

import flexsp
from flexsp.errors import PlanError
from flexsp.plan.strategies import parse_strategy
from flexsp.plan.lengths import LengthDistribution, get_distribution, preprocess

from outputs import RESULTS, resolve_out
DATASETS = ("github", "commoncrawl", "wikipedia")
MODELS = ("gpt-7b", "gpt-13b", "gpt-30b")

# Published figures of the paper (arXiv 2412.01523), for side-by-side columns.
PAPER_MAX_SPEEDUP = {"megatron": 1.98, "deepspeed": 1.72, "batchada": 1.42}
PAPER_BUCKET_ERROR = {"github": (0.7, 13.4), "commoncrawl": (0.5, 8.8), "wikipedia": (2.3, 22.1)}  # DP, naive (%)
PAPER_A2A_SHARE = {"deepspeed": "up to 40%", "batchada": "~31%", "flexsp": "~10%"}


def parser(doc: str, default_stem: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI mode: few small batches (seconds)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the .md/.csv/.png outputs (default: experiments/results/, a temporary "
                        "folder with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", dest="no_progress", action="store_true", help="no progress bar (as flexsp simulate)")
    p.add_argument("--no-progress", dest="no_progress", action="store_true", help=argparse.SUPPRESS)   # old spelling
    p.add_argument("--workers", type=int, default=1,
                   help="plan this many batches at once in separate processes (flexsp.evaluation.simulate.plan_steps)")
    p.add_argument("--replot", action="store_true",
                   help="redraw the figure from the CSV already in --out (no planning)")
    p.set_defaults(stem=default_stem)
    return p


def batch_options(p: argparse.ArgumentParser, batches: int, time_limit: float, datasets: bool = True) -> None:
    """The options of the scripts that plan seeded global batches: how many, how big, the solver's
    time limit, and (``datasets``) which length distributions."""
    p.add_argument("--batches", type=int, default=batches)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--time-limit", type=float, default=time_limit)
    if datasets:
        p.add_argument("--datasets", nargs="+", default=list(DATASETS))


def replotted(args: argparse.Namespace, draw) -> bool:
    """With ``--replot``, ``draw(rows, png)`` from the CSV already in ``--out`` (no planning); whether it did."""
    if not args.replot:
        return False
    draw(read_csv(args.out / f"{args.stem}.csv"), args.out / f"{args.stem}.png")
    return True


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, then place the outputs: experiments/results/ for a full run, a temporary folder for --quick."""
    args = p.parse_args()
    args.out = resolve_out(args.out, args.quick, RESULTS)
    return args


def distribution(name: str) -> LengthDistribution:
    return get_distribution(name)


def label(dist: LengthDistribution) -> str:
    """Dataset name as printed everywhere: approximations say so."""
    return f"{dist.name} (approx.)" if dist.approximate else dist.name


def provenance(names: Sequence[str]) -> str:
    """One Markdown bullet per distribution used: where its lengths come from."""
    return "\n".join(f"- `{n}`: {distribution(n).source}" for n in names)


def batches(dist: LengthDistribution, count: int, batch_size: int, context: int, num_gpus: int,
            seed: int) -> Iterator[np.ndarray]:
    """Seeded global batches with the paper's preprocessing, as ``flexsp.evaluation.simulate`` draws them."""
    pool = dist.lengths[dist.lengths <= context]
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield preprocess(pool[rng.integers(0, pool.size, size=batch_size)], context, num_gpus)[0]


def plan_time(lengths: np.ndarray, cost: flexsp.CostModel, cluster: flexsp.Cluster, name: str,
              time_limit: float) -> flexsp.Plan | None:
    """A plan for strategy ``name`` (``static:D`` pins the degree, ``[1,8,64]`` restricts degrees), or None
    when it cannot hold the batch."""
    spec = parse_strategy(name)
    try:
        return flexsp.plan_batch(lengths, cost, cluster, spec.strategy, sp_degree=spec.sp_degree,
                                 degrees=spec.degrees, time_limit=time_limit)
    except PlanError:
        return None


def fmt(value: float, digits: int = 2, suffix: str = "") -> str:
    if value is None or not np.isfinite(value):
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})
    return path


SIMULATED = ("**Simulated, not measured**: times are predicted by the paper's published cost model "
             "(`flexsp.cost_from_preset`, GPT-7B/13B/30B constants for 64 x A100-40GB); solve times, where shown, "
             "are measured on this project's 2-core shared CPU.")


def write_markdown(path: Path, title: str, body: str, started: float, quick: bool, label: str = SIMULATED) -> Path:
    """``label`` says what the figures are (simulated with which cost model, or measured on what)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "quick mode (CI smoke run, not the paper's protocol)" if quick else "full mode"
    command = "python " + " ".join([Path(sys.argv[0]).as_posix().split("/main/")[-1], *sys.argv[1:]])
    head = f"{label}\n\n" if label else ""
    path.write_text(f"## {title}\n\n{head}{body}\n\n_{mode}; `{command}`; {time.time() - started:.0f} s on this machine._\n")
    return path


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV this package wrote, with numbers and booleans read back as such (for ``--replot``)."""
    def value(text: str):
        if text in ("True", "False"):
            return text == "True"
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text
    with path.open(newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def save_figure(fig, path: Path, data: Path) -> Path:
    """Save ``fig`` with its provenance in the PNG: the script that drew it and the SHA-256 of the data
    file it plotted (``tests/test_figures.py`` checks that every image the docs show is current)."""
    from flexsp.evaluation.plots import save_with_provenance
    return save_with_provenance(fig, path, source=f"experiments/{Path(sys.argv[0]).name}", data=data)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def log_axis(ax, ticks: Sequence[float], axis: str = "x") -> None:
    """A log-scale axis labelled only at ``ticks``: matplotlib also labels the minor ticks of an axis that
    spans less than a decade or two (``2x10^1``, ``3x10^1``, ...), and those labels collide with the major ones."""
    from matplotlib.ticker import NullFormatter
    getattr(ax, f"set_{axis}scale")("log")
    getattr(ax, f"set_{axis}ticks")(list(ticks), [f"{t:g}" for t in ticks])
    getattr(ax, f"{axis}axis").set_minor_formatter(NullFormatter())


def wrap_title(text: str, width_inches: float, fontsize: float = 9) -> str:
    """``text`` broken into lines that fit a figure ``width_inches`` wide at ``fontsize`` points (a
    figure's suptitle is not wrapped by matplotlib, and a long one is cut off at the edges)."""
    import textwrap
    return textwrap.fill(text, max(20, int(width_inches * 72 / (fontsize * 0.6))))
