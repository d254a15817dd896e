"""Regenerate the generated blocks of README.md and docs/*.md from the commands and result files that own them.

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``. ``simulate``
is the output of the README's default command (``flexsp simulate``); ``file:FILE`` copies the whole of
``experiments/results/FILE``; ``results:FILE`` copies the block of the same name out of it, where the benchmark script that owns the
figures wrote it; ``families`` is the HF families table's totals; ``calibration`` tabulates the measured presets (``flexsp/plan/measured/``) with their fit and replay
errors and any GPU run of ``experiments/gpu_replay.py``. ``--check`` exits 1 when the README differs (for ``simulate``, solve times and the
time-limited search's plan details, which vary from run to run, are ignored; its total time must agree
within 1%: see ``simulation_differs``).

    python experiments/readme_tables.py            # rewrite README.md and docs/*.md in place
    python experiments/readme_tables.py --check    # what CI's test does
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def documents() -> list[Path]:
    """Every page that may hold generated blocks."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w:.#\-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


# The default 2 s time limit never binds on this table on an idle 2-core machine (FlexSP solves in
# under 1 s), but it can on a loaded one, and a binding limit changes plans. A limit that cannot bind
# makes the block depend on the solver alone; the solve-time column shows what each solve took.
TIME_LIMIT = "60"


def default_simulation() -> str:
    """What ``flexsp simulate`` prints on the bundled default, inside a text fence."""
    from flexsp.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["simulate", "--quiet", "--time-limit", TIME_LIMIT])
    if status:
        raise SystemExit(f"flexsp simulate exited with {status}")
    return "```\n" + out.getvalue().rstrip("\n") + "\n```\n"


def results_block(file_name: str, name: str) -> str:
    """The block ``name`` that a benchmark script wrote into its results file."""
    text = (ROOT / "experiments" / "results" / file_name).read_text()
    for match in BLOCK.finditer(text):
        if match.group("name") == name:
            return match.group("body")
    raise SystemExit(f"experiments/results/{file_name} has no generated block {name!r}")


def results_file(file_name: str) -> str:
    """A whole results file as its script wrote it, less its title line (the page has its own heading);
    links inside it are made relative to docs/."""
    text = (ROOT / "experiments" / "results" / file_name).read_text()
    lines = text.splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    body = "\n".join(lines).strip("\n")
    body = re.sub(r"\]\((?!https?:|\.\./|/|#)([^)]+)\)", r"](../experiments/results/\1)", body)
    return body.replace("<!-- generated: ", "<!-- inner: ").replace("<!-- end: ", "<!-- inner-end: ") + "\n"


def calibration() -> str:
    """The measured presets against the hardware they came from: each preset's compute-fit error (its profile's
    ``meta``) and the replay that checked it (the results file its provenance names), then the e2e comparison
    replayed with measured compute (``experiments/gpu_replay.py``) wherever a GPU run left its results."""
    import json

    from flexsp.plan.measured_presets import preset_files, read_preset

    rows = ["| measured preset | measured on | measured | assumed | compute fit error (mean / max) | replay check: "
            "group compute error (mean / max) | replay check: step replayed vs predicted (prediction error) |",
            "|---|---|---|---|---|---|---|"]
    for name, path in preset_files().items():
        document = read_preset(path)
        meta, provenance = document["profile"]["meta"], document["provenance"]
        compute, lengths = meta["compute"], meta.get("lengths") or [0]
        check = provenance.get("replay_check")
        replay = json.loads((ROOT / check).read_text()) if check and (ROOT / check).is_file() else None
        assumed = meta.get("assumed") or {}
        cells = [f"`{name}`", f"{meta['device']} (driver {provenance['driver']}, torch {meta['torch']}), {meta['date'][:10]}",
                 f"compute ({min(lengths):,}-{max(lengths):,} tokens, {meta.get('dtype')}), activation memory",
                 f"all-to-all and ring: `{assumed.get('interconnect')}` figures" if assumed else "nothing",
                 f"{compute['mean_abs_rel_error']:.2%} / {compute['max_abs_rel_error']:.2%}"]
        if replay:
            step = replay["step"]
            tokens = sum(g["tokens"] for g in replay["groups"])
            cells += [f"{step['group_compute_mean_abs_error']:.1%} / {step['group_compute_max_abs_error']:.1%} "
                      f"([{len(replay['groups'])} groups of a plan for {replay['num_gpus']} GPUs, {tokens:,} tokens]({check}))",
                      f"{step['replayed_time']:.3f} s vs {step['predicted_time']:.3f} s ({step['step_error']:+.1%})"]
        else:
            cells += ["not checked", ""]
        rows.append("| " + " | ".join(cells) + " |")
    replays = sorted((ROOT / "experiments" / "results").glob("gpu_replay_*.md"))
    if replays:
        tail = "\n\n".join(replay_block(p) for p in replays)
    else:
        tail = ("The paper's comparison replayed with this measured compute (`python experiments/gpu_replay.py`: every "
                "strategy's plans for 64 GPUs, each group's compute measured on one GPU, communication modelled; about "
                "15 minutes on one H200) has not run yet: no GPU was at hand when it was written.")
    return ("Measured on a real GPU (compute and memory; the all-to-all and ring are assumed, since one GPU measures no "
            "all-to-all). `flexsp simulate --model NAME` plans with a measured preset and prints its provenance.\n\n"
            + "\n".join(rows) + "\n\n" + tail + "\n")


def replay_block(md: Path) -> str:
    """One gpu_replay results table, headed by what ran it: the device, the preset, how much was replayed."""
    state = json.loads(md.with_suffix(".json").read_text())
    s, device = state["setting"], state.get("device") or {}
    done = {key.split("/")[0] for key in state["replays"]}
    head = (f"The paper's comparison replayed with measured compute ([{md.stem}](experiments/results/{md.name}), "
            f"`python experiments/gpu_replay.py`): {s['preset']}'s plans for {s['gpus']} GPUs, "
            f"{device.get('label', 'nothing replayed yet')}; {len(state['replays'])} replays over {len(done)} of "
            f"{s['steps']} step(s)" + (f" (**incomplete**: {state['stopped']})" if state.get("stopped") else "") + ":")
    return head + "\n\n" + "\n".join(line for line in md.read_text().splitlines() if line.startswith("|"))


def gpu_step() -> str:
    """The executed step on a GPU against its targets (``experiments/gpu_step_benchmark.py``'s results file, written
    only by a CUDA run), or the plain statement that no GPU has run it."""
    import json

    path = ROOT / "experiments" / "results" / "gpu_step.json"
    what = ("The executed step on a GPU (`python experiments/gpu_step_benchmark.py`: the executor against the plain "
            "per-sequence loop and the HF adapter against native per-sequence Hugging Face, at a Llama-3-8B layer "
            "shape with 2 layers, bf16)")
    if not path.is_file():
        return (what + " has not run since the CUDA fixes and the kernel rule: no GPU was at hand. The first GPU run "
                "(before them) found the step slower than the plain loop; the targets it must meet are in the "
                "script.\n")
    result = json.loads(path.read_text())
    lines = [f"{what}, **measured** on {result['device']} (torch {result['torch']}, {result['date'][:10]}; LM-head "
             f"loss: {result['lm_head_loss']}):", ""]
    lines += [f"- {v['what']}: {v['value']:.3g} (target {v['target']}) {'met' if v['met'] else '**MISSED**'}"
              for v in result["verdicts"]]
    return "\n".join(lines) + "\n"


def families() -> str:
    """The Hugging Face families table's totals (``docs/hf_families.md``, written by ``experiments/hf_families.py``)."""
    text = (ROOT / "docs" / "hf_families.md").read_text()
    totals = next(line for line in text.splitlines() if line.startswith("Totals: "))
    source = re.search(r"\((transformers [^)]*)\)", text)
    return (f"Every causal-LM model type of transformers, built tiny in fp64 and stepped under a heterogeneous plan "
            f"on 4 gloo ranks against the unmodified model ({source.group(1) if source else 'see the page'}; "
            f"measured by `python experiments/hf_families.py`, the whole table in "
            f"[docs/hf_families.md](docs/hf_families.md)):\n\n**{totals[len('Totals: '):]}**\n")


def render(name: str) -> str:
    if name == "gpu_step":
        return gpu_step()
    if name == "families":
        return families()
    if name == "simulate":
        return default_simulation()
    if name == "calibration":
        return calibration()
    if name.startswith("file:"):
        return results_file(name.split(":", 1)[1])
    if name.startswith("results:"):
        file_name, _, block = name.split(":", 1)[1].partition("#")
        return results_block(file_name, block or "readme")
    raise SystemExit(f"README has a generated block {name!r} that no source owns")


def without_timings(text: str) -> str:
    """Drop the last column of table rows (the simulate table's solve time, which varies per run)."""
    return "\n".join(re.sub(r"\|[^|]*\|\s*$", "|", line) if line.startswith("|") else line
                     for line in text.splitlines())


SEARCHED = {"flexsp"}      # strategies whose plan depends on how much search the time limit buys
TOLERANCE = 0.01          # ... so their total time is compared within 1%, their other cells not at all


def simulation_differs(fresh: str, old: str) -> bool:
    """Whether the README's simulate block is stale. Every line must match except: the solve-time column
    (varies per run); rows of time-limited searches (``SEARCHED``), whose total time must agree within
    ``TOLERANCE`` (a loaded machine buys less search, so their plan and its groups shift slightly); and the
    ``flexsp speedup`` column, which divides by FlexSP's time."""
    def parse(text: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
        lines = without_timings(text).strip().splitlines()
        header = next((line for line in lines if line.startswith("| strategy")), "")
        columns = [c.strip() for c in header.strip("|").split("|")]
        other, rows = [], {}
        for line in lines:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if line.startswith("| ") and line != header and len(cells) == len(columns):
                rows[cells[0]] = cells
            else:
                other.append(line)
        return other, rows, columns

    fresh_other, fresh_rows, columns = parse(fresh)
    old_other, old_rows, old_columns = parse(old)
    if fresh_other != old_other or columns != old_columns or fresh_rows.keys() != old_rows.keys():
        return True
    total = columns.index("total time (s)") if "total time (s)" in columns else 1
    speedup = columns.index("flexsp speedup") if "flexsp speedup" in columns else None
    for name, cells in fresh_rows.items():
        before = old_rows[name]
        if name in SEARCHED:
            try:
                if abs(float(cells[total]) - float(before[total])) > TOLERANCE * float(cells[total]):
                    return True
            except ValueError:
                return cells[total] != before[total]
            continue
        if [c for i, c in enumerate(cells) if i != speedup] != [c for i, c in enumerate(before) if i != speedup]:
            return True
    return False


def update(text: str) -> tuple[str, list[str]]:
    """README text with every block regenerated, and the names of blocks whose content changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        name, body = match.group("name"), match.group("body")
        fresh = render(name)
        stale = simulation_differs(fresh, body) if name == "simulate" else fresh.strip() != body.strip()
        if stale:
            changed.append(name)
        return match.group(1) + fresh + match.group(4)

    return BLOCK.sub(replace, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is out of date; write nothing")
    args = parser.parse_args(argv)
    stale = {}
    for page in documents():
        fresh, changed = update(page.read_text())
        name = page.relative_to(ROOT)
        if changed:
            stale[str(name)] = changed
        if not args.check:
            page.write_text(fresh)
            print(f"{name}: regenerated; changed blocks: {changed or 'none'}")
    if args.check:
        if stale:
            print(f"out of date: {stale}: run python experiments/readme_tables.py")
            return 1
        print("generated blocks are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
