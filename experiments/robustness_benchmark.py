"""Robustness under load: every strategy against its time limit, every parser against its memory.

1. **Planning deadlines**: wall-clock time of ``plan_batch`` per strategy at 10^4, 10^5 and 10^6
   sequences (bundled Wikipedia lengths, 64 GPUs, the paper's gpt-7b preset at 384K), against its
   ``time_limit``; the target is the limit + 1 s (the conversion to ranks and validation on top),
   printed as MISSED when exceeded. Measured on this machine (load average printed).
2. **Parser memory**: peak RSS growth of a fresh process while it reads one file, per MiB of input, for
   each reader (lengths as text, gzip and .npy; a plan, a cost model and a bandwidth table as JSON);
   each has a target, MISSED when exceeded. Measured.

``--quick`` (CI): 10^3 and 10^4 sequences, small files, writes only under ``--out``.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flexsp  # noqa: E402
from flexsp.plan.lengths import get_distribution, preprocess  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, markdown_table, parser, write_markdown  # noqa: E402
from outputs import resolve_out  # noqa: E402

STRATEGIES = ("flexsp", "greedy", "batchada", "static", "dynamic-cp")
SLACK = 1.0   # seconds past the limit a plan may take (ranks, validation)
# peak RSS growth a reader may use: (MiB per MiB of input, fixed MiB of scratch). A lengths file's result
# is about 1 MiB per MiB of text (8 bytes a length); the text parser adds one 1 MiB chunk's scratch.
MEMORY_TARGET = {"lengths .txt": (2.5, 32), "lengths .txt.gz (per MiB decompressed)": (2.5, 32),
                 "lengths .npy": (2.5, 8), "plan JSON": (40, 32), "cost model JSON": (40, 32),
                 "bandwidth JSON": (40, 32)}


def planning_rows(sizes: list[int], time_limit: float) -> list[dict]:
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64)
    cluster = flexsp.Cluster(64, 8)
    dist = get_distribution("wikipedia")
    rows = []
    for n in sizes:
        lengths, _ = preprocess(dist.sample_batch(n, 0), 384 * 1024, 64)
        for name in STRATEGIES:
            started = time.perf_counter()
            try:
                plan = flexsp.plan_batch(lengths, cost, cluster, name, time_limit=time_limit)
                note = f"{len(plan.micro_batches)} micro-batches"
            except flexsp.FlexSPError as exc:
                note = f"refused: {str(exc)[:60]}"
            seconds = time.perf_counter() - started
            missed = seconds > time_limit + SLACK
            rows.append({"sequences": f"{n:,}", "strategy": name, "seconds": f"{seconds:.2f}",
                         "limit + 1 s": f"{time_limit + SLACK:.1f}", "target": "MISSED" if missed else "met",
                         "load": f"{os.getloadavg()[0]:.1f}", "plan": note})
            print(f"{n:>9,} {name:<11} {seconds:7.2f} s (limit {time_limit} s){'  MISSED' if missed else ''}",
                  flush=True)
    return rows


_READ = {
    "lengths": "from flexsp.plan.lengths import load_lengths as read",
    "plan": "from flexsp.plan.types import Plan; read = Plan.load",
    "cost": "from flexsp.plan.cost import CostModel; read = CostModel.load",
    "bandwidth": "from flexsp.replay.comm_time import load_bandwidth_table as read",
}


def _peak_mib(kind: str, path: Path) -> float:
    script = textwrap.dedent(f"""
        def kib(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1])
        {_READ[kind]}
        open("/proc/self/clear_refs", "w").write("5")   # reset the peak: the imports' transient does not count
        before = kib("VmRSS")
        read({str(path)!r})
        print((kib("VmHWM") - before) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "FLEXSP_MAX_JSON_BYTES": "1G",
                              "FLEXSP_MAX_GROUPS": "100M", "FLEXSP_MAX_SEQUENCES": "1G"})
    if out.returncode:
        raise RuntimeError(out.stderr[-500:])
    return float(out.stdout.strip().splitlines()[-1])


def memory_rows(mib: float, folder: Path) -> list[dict]:
    rng = np.random.default_rng(0)
    n = int(mib * 2**20 / 8)                      # 7-digit lengths: 8 bytes a line
    values = rng.integers(1_000_000, 9_999_999, n)
    text = ("\n".join(map(str, values.tolist())) + "\n").encode()
    files = {"lengths .txt": ("lengths", folder / "l.txt", text),
             "lengths .txt.gz (per MiB decompressed)": ("lengths", folder / "l.txt.gz", gzip.compress(text, 1)),
             "lengths .npy": ("lengths", folder / "l.npy", None)}
    np.save(folder / "l.npy", values)
    groups = int(mib * 2**20 / 40)
    plan = {"num_gpus": 64, "predicted_time": 1.0,
            "micro_batches": [{"groups": [{"ranks": [0], "seq_ids": [i]}]} for i in range(groups)]}
    files["plan JSON"] = ("plan", folder / "plan.json", json.dumps(plan).encode())
    cost = flexsp.cost_from_preset("gpt-7b", context=384 * 1024, num_gpus=64).to_dict()
    cost["meta"] = {"padding": ["x" * 30] * int(mib * 2**20 / 34)}   # a cost model with a large meta
    files["cost model JSON"] = ("cost", folder / "cost.json", json.dumps(cost).encode())
    table = {"alltoall_bandwidth": {"2": 1e9}, "meta": {"samples": rng.random(int(mib * 2**20 / 21)).tolist()}}
    files["bandwidth JSON"] = ("bandwidth", folder / "bw.json", json.dumps(table).encode())
    rows = []
    for name, (kind, path, data) in files.items():
        if data is not None:
            path.write_bytes(data)
        size = (len(text) if name.startswith("lengths .txt.gz") else path.stat().st_size) / 2**20
        peak = _peak_mib(kind, path)
        per = peak / size
        slope, fixed = MEMORY_TARGET[name]
        missed = peak > slope * size + fixed
        rows.append({"reader": name, "input MiB": f"{size:.1f}", "peak growth MiB": f"{peak:.0f}",
                     "MiB per MiB": f"{per:.2f}", "target": f"<= {slope:g} x input + {fixed} MiB",
                     "result": "MISSED" if missed else "met"})
        print(f"{name:<40} {size:6.1f} MiB in, {peak:6.0f} MiB peak, {per:5.2f} per MiB{'  MISSED' if missed else ''}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, "robustness")
    p.add_argument("--time-limit", type=float, default=2.0)
    p.add_argument("--mib", type=float, default=32.0, help="input size of the parser measurements (full mode)")
    args = p.parse_args(argv)
    args.out = resolve_out(args.out, args.quick, RESULTS)
    started = time.time()
    sizes = [1_000, 10_000] if args.quick else [10_000, 100_000, 1_000_000]
    plans = planning_rows(sizes, args.time_limit)
    with tempfile.TemporaryDirectory() as folder:
        memory = memory_rows(2.0 if args.quick else args.mib, Path(folder))
    machine = f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
    body = "\n\n".join([
        f"### Planning time against the time limit ({args.time_limit:g} s; target: limit + {SLACK:g} s)",
        f"**Measured** on this machine ({machine}): wall-clock `plan_batch`, bundled Wikipedia lengths, 64 GPUs "
        f"(8 per node), gpt-7b preset at 384K.",
        markdown_table(plans, ["sequences", "strategy", "seconds", "limit + 1 s", "target", "load", "plan"]),
        "### Parser peak memory per MiB of input",
        "**Measured**: peak RSS growth of a fresh Python process while one reader reads one file "
        "(caps raised for the measurement).",
        markdown_table(memory, ["reader", "input MiB", "peak growth MiB", "MiB per MiB", "target", "result"]),
    ])
    out = args.out if args.out.suffix == ".md" else args.out / "robustness.md"
    written = write_markdown(out, "Robustness: deadlines and bounded parsers", body, started, args.quick, label="")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
