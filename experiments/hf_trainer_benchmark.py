"""HF Trainer with and without FlexSP: tokens/s on a long-tailed length mix (gloo on CPU), and the family table.

    python experiments/hf_trainer_benchmark.py            # writes experiments/results/hf_trainer_benchmark.md
    python experiments/hf_trainer_benchmark.py --quick    # CI: tiny, writes only under a temporary directory

Four runs of ``examples/hf_trainer.py`` (small Llama, fp32, the same global batches of a long-tailed
length mix): the plain Trainer in one process (padded batches) and FlexSP in one process (degree 1),
then the plain Trainer under DDP on 4 ranks and FlexSP on 4 ranks (the plan's degrees). MEASURED on
this machine's CPUs with gloo (the load average is printed beside each figure): CPU numbers say how
the integration behaves, not what a GPU cluster gains. The FlexSP runs record every step
(``flexsp.telemetry``), and a second table splits their time into where it went: the loader's wait
(the first step's apart from the later steps', which are split into waiting for plans, where the
solver is slower than the step, and fetch + pack the prefetch did not hide), the
executor's checks, forward + backward of the micro-batches (kernels, with the all-to-all inside),
ranks idle while others ran, the step's tail (gradient exchange over the world) and the Trainer's
own work outside the step (optimizer, scheduler, logging), against the plain run's time, with `flexsp report`'s
"waiting for the loader (mean fraction of loop)". A fifth run is the example as its docstring launches it (its
default shapes, 4 ranks), for that figure's target (<= 5%, issue 43). The family matrix's totals come from
docs/hf_families.md (``experiments/hf_families.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import torchrun

from flexsp.telemetry.records import read_records

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
RESULTS = ROOT / "experiments" / "results" / "hf_trainer_benchmark.md"
FAMILIES = ROOT / "docs" / "hf_families.md"


def run(label: str, ranks: int, flexsp: bool, workdir: Path, argv: list[str]) -> dict:
    launcher, env = torchrun(ranks)
    history = workdir / f"{label}.json"
    records = workdir / f"{label}-telemetry"
    cmd = [*launcher, str(EXAMPLE), *argv, "--dtype", "float32", "--save-steps", "1000000",
           "--out", str(workdir / label), "--history", str(history),
           *(["--run-dir", str(records)] if flexsp else ["--no-flexsp"])]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, cwd=workdir)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    out = json.loads(history.read_text())
    losses = out["losses"]
    steps = read_records(records) if flexsp else []
    return {"label": label, "ranks": ranks, "flexsp": flexsp, "tokens": out["tokens"], "seconds": out["seconds"],
            "tok_s": out["tokens"] / out["seconds"], "final_loss": losses[max(losses, key=int)], "load": load,
            "parts": breakdown(steps, out["seconds"]) if flexsp else None,
            **({"waits": [r["plan_wait"] + r["load_seconds"] for r in steps],
                "loops": [r["loop_seconds"] for r in steps]} if flexsp else {})}


PARTS = (("loader wait, first step (its plan made in this process before the planner process is spawned)", "first_wait"),
         ("loader wait, later steps: for plans (the solver slower than the step)", "later_plan"),
         ("loader wait, later steps: fetch + pack not hidden", "later_load"),
         ("executor checks (plan and shapes agreed by every rank)", "check"),
         ("forward + backward of the micro-batches (kernels, all-to-all inside)", "compute"),
         ("idle: ranks sitting out a micro-batch or waiting in collectives (on a busy CPU: for a core too)", "idle"),
         ("step tail (gradient exchange over the world)", "tail"),
         ("Trainer outside the step (setup, optimizer, scheduler, logging, callbacks)", "trainer"))


def breakdown(records: list[dict], runtime: float) -> dict[str, float]:
    """Seconds of a FlexSP run by part, from its step records (slowest rank per step, as the records hold them).

    The micro-batch time is their wall time less the idle part, so the parts add up to about the Trainer's runtime."""
    wait = [r["plan_wait"] + r["load_seconds"] for r in records]
    idle = sum(r["idle_seconds"] for r in records)
    mbs = sum(mb["measured"] for r in records for mb in r["micro_batches"])
    loop = sum(r["loop_seconds"] for r in records)
    return {"first_wait": wait[0], "later_plan": sum(r["plan_wait"] for r in records[1:]),
            "later_load": sum(r["load_seconds"] for r in records[1:]), "check": sum(r["check_seconds"] for r in records),
            "compute": max(0.0, mbs - idle), "idle": idle, "tail": sum(r["tail_seconds"] for r in records),
            "trainer": runtime - loop, "loop_wait_fraction": sum(wait) / loop,
            "later_wait_fraction": sum(wait[1:]) / max(1e-12, sum(r["loop_seconds"] for r in records[1:])),
            "report_fraction": sum(r["loader_fraction"] for r in records) / len(records)}   # `flexsp report`'s figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny run for CI; writes only to a temporary directory")
    parser.add_argument("--out", type=Path, default=None, help="result markdown (default: experiments/results/...)")
    args = parser.parse_args(argv)
    if args.quick:
        example = ["--steps", "2", "--batch", "8", "--sequences", "16", "--tokens-per-rank", "96"]
    else:
        example = ["--steps", "6", "--batch", "16", "--sequences", "96", "--tokens-per-rank", "512"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [run("plain, 1 process", 1, False, work, example), run("flexsp, 1 process (degree 1)", 1, True, work, example),
                run("plain DDP, 4 ranks", 4, False, work, example),
                run("flexsp, 4 ranks (plan's degrees)", 4, True, work, example)]
        # the example as its docstring runs it (its default shapes), for `flexsp report`'s loader figure
        default = ["--steps", "2" if args.quick else "6"]
        documented = run("flexsp, 4 ranks, the example's defaults", 4, True, work, default)
    lines = ["# HF Trainer with and without FlexSP", "",
             f"MEASURED on {platform.processor() or platform.machine()} CPUs, gloo, fp32, small Llama (2 layers, hidden 64), "
             f"`examples/hf_trainer.py {' '.join(example)}`{' (quick mode)' if args.quick else ''}. "
             "Same global batches of a long-tailed length mix in every run; tokens are real (unpadded) tokens.", "",
             "| run | ranks | tokens | seconds | tokens/s | final loss | load avg |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['ranks']} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.0f} | "
                     f"{r['final_loss']:.4f} | {r['load']:.1f} |")
    plain = {r["ranks"]: r for r in rows if not r["flexsp"]}
    flex = [r for r in rows if r["flexsp"]]
    lines += ["", "Where the FlexSP runs' time goes (seconds, from their step records; the gap is FlexSP's "
              "runtime less the plain run's on as many ranks):", "",
              "| part | " + " | ".join(f"{r['label']}" for r in flex) + " |", "|---|" + "---|" * len(flex)]
    for name, key in PARTS:
        lines.append(f"| {name} | " + " | ".join(f"{r['parts'][key]:.3f}" for r in flex) + " |")
    lines.append("| **FlexSP runtime** | " + " | ".join(f"{r['seconds']:.3f}" for r in flex) + " |")
    lines.append("| plain runtime, same ranks | " + " | ".join(f"{plain[r['ranks']]['seconds']:.3f}" for r in flex) + " |")
    lines.append("| gap (FlexSP - plain) | " + " | ".join(f"{r['seconds'] - plain[r['ranks']]['seconds']:+.3f}"
                                                         for r in flex) + " |")
    lines.append("| loop waiting for the loader: all steps / after the first (target <= 5%) | " + " | ".join(
        f"{r['parts']['loop_wait_fraction']:.1%} / {r['parts']['later_wait_fraction']:.1%}"
        f"{'' if r['parts']['later_wait_fraction'] <= 0.05 else ' MISSED'}" for r in flex) + " |")
    lines.append("| `flexsp report`: waiting for the loader (mean fraction of loop; target <= 5%) | " + " | ".join(
        f"{r['parts']['report_fraction']:.1%}{'' if r['parts']['report_fraction'] <= 0.05 else ' MISSED'}"
        for r in flex) + " |")
    frac = documented["parts"]["report_fraction"]
    lines += ["", f"`torchrun --nproc_per_node=4 examples/hf_trainer.py {' '.join(default)}` (the example's default "
              f"shapes; load avg {documented['load']:.1f} at its start): `flexsp report` says the loop waits for the "
              f"loader {frac:.1%} of its time (mean over its {len(documented['waits'])} steps; first step "
              f"{documented['waits'][0] * 1e3:.0f} ms of {documented['loops'][0] * 1e3:.0f} ms) (target <= 5%)"
              f"{'' if frac <= 0.05 else ': MISSED'}"]
    if FAMILIES.is_file():
        totals = next((line for line in FAMILIES.read_text().splitlines() if line.startswith("Totals:")), None)
        lines += ["", f"Family matrix (docs/hf_families.md, `experiments/hf_families.py`): {totals}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
