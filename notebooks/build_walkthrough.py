"""Build notebooks/walkthrough.ipynb from the cells below (committed without outputs).

The notebook is generated so that its source is reviewable as plain Python; edit here, then run
``python notebooks/build_walkthrough.py``. tests/test_notebook.py executes the result.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS: list[tuple[str, str]] = [
    ("md", """# FlexSP walkthrough: from sequence lengths to a plan and a speedup

This notebook runs on a laptop CPU in well under a minute. It follows one training step of
**heterogeneous sequence parallelism** (FlexSP, Wang et al., ASPLOS 2025): a batch of documents of
very different lengths, a cost model of the cluster, a plan that splits the GPUs into SP groups of
different sizes, its picture, and a simulation that compares strategies over several steps."""),
    ("md", """## 1. A length distribution

The bundled Wikipedia sample holds 1,000,000 real document lengths (tokens). `github` and
`commoncrawl` also exist, but they are labelled **approximations** of the paper's corpora."""),
    ("code", """import numpy as np
import flexsp
from flexsp.plan.lengths import get_distribution, preprocess

dist = get_distribution("wikipedia")
print(dist.describe())
print(get_distribution("github").describe())"""),
    ("md", """## 2. A cluster and a cost model

The paper's published constants for GPT-7B on 64 A100-40GB GPUs (8 nodes of 8), at a 384K-token
context limit. `seq_time(s, d)` is the time of one sequence of `s` tokens in an SP group of `d` GPUs:
compute shrinks with `d`, but beyond one node the all-to-all traffic gets expensive."""),
    ("code", """CONTEXT, N = 384 * 1024, 64
cost = flexsp.cost_from_preset("gpt-7b", context=CONTEXT, num_gpus=N)
cluster = flexsp.Cluster(num_gpus=N, gpus_per_node=8)
print(f"one GPU holds {cost.token_capacity:.0f} tokens of activations")
for s in (1_000, 30_000, 300_000):
    row = {d: round(cost.seq_time(s, d), 3) for d in (1, 8, 16, 64) if s <= cost.group_capacity(d)}
    print(f"{s:>7} tokens: seconds by SP degree {row}")"""),
    ("md", """## 3. One global batch, planned

We draw 512 lengths, apply the paper's preprocessing (drop sequences above the context limit, pad to a
multiple of 2N) and ask for a FlexSP plan: micro-batches, each a set of SP groups on disjoint ranks."""),
    ("code", """rng = np.random.default_rng(0)
pool = dist.lengths[dist.lengths <= CONTEXT]
lengths, dropped = preprocess(pool[rng.integers(0, pool.size, size=512)], CONTEXT, N)
print(f"{lengths.size} sequences, {lengths.sum():,} tokens, longest {lengths.max():,}")

plan = flexsp.plan_batch(lengths, cost, cluster, "flexsp", time_limit=1.0)
print(f"FlexSP: {plan.predicted_time:.2f} s per step, {len(plan.micro_batches)} micro-batches, solved in {plan.solve_time:.2f} s")
for m, mb in enumerate(plan.micro_batches):
    degrees = sorted((g.degree for g in mb.groups), reverse=True)
    print(f"  micro-batch {m}: {len(mb.groups)} groups, degrees {degrees[:12]}{' ...' if len(degrees) > 12 else ''}")"""),
    ("md", """## 4. Its picture

Ranks on the y axis, time on the x axis, one box per SP group; the dotted lines end micro-batches."""),
    ("code", """import tempfile
from pathlib import Path
from IPython.display import Image, display
from flexsp.evaluation.plots import plot_gantt

picture = Path(tempfile.mkdtemp()) / "plan.png"
plot_gantt(plan, lengths, cost, picture)
display(Image(filename=str(picture)))"""),
    ("md", """## 5. The same batch, other strategies

`static` is DeepSpeed-Ulysses style (one SP degree for everything), `batchada` picks the best single
degree per batch, `dynamic-cp` is Megatron's dynamic context-parallel rule. `flexsp.evaluation.megatron` gives a
Megatron-LM-style TP=8 + ring-attention step time (not a plan of SP groups)."""),
    ("code", """from flexsp.evaluation.megatron import MegatronModel, megatron_step_time

for strategy, degree in (("static", 64), ("static", 32), ("batchada", None), ("dynamic-cp", None)):
    other = flexsp.plan_batch(lengths, cost, cluster, strategy, sp_degree=degree)
    name = strategy + (f" {degree}" if degree else "")
    print(f"{name:>12}: {other.predicted_time:6.2f} s  (FlexSP is {other.predicted_time / plan.predicted_time:.2f}x faster)")
step = megatron_step_time(lengths, MegatronModel.from_preset("gpt-7b", context=CONTEXT, num_gpus=N), N)
print(f"{'megatron':>12}: {step.time:6.2f} s  (TP 8 x CP {step.cp}; FlexSP is {step.time / plan.predicted_time:.2f}x faster)")"""),
    ("md", """## 6. A short simulation and a speedup table

`flexsp.evaluation.simulate` plans several seeded batches with every strategy (`static:D` pins a degree). The
paper's protocol is 40 steps of 512; here 3 steps of 256 keep it quick."""),
    ("code", """from IPython.display import Markdown
from flexsp.evaluation.simulate import simulate, format_table, describe

sim = simulate(dist, cost, cluster, ["flexsp", "batchada", "dynamic-cp", "static:64", "static:32"],
               steps=3, batch_size=256, context=CONTEXT, config=flexsp.PlanConfig(time_limit=0.5),
               progress=False)
print(describe(sim))
display(Markdown(format_table(sim)))"""),
    ("md", """## Where next

- `experiments/e2e_speedup.py`, `bucketing_error.py`, `case_study.py`, `scalability.py`,
  `ablations.py` reproduce the paper's tables and figures by simulation (`--quick` for a smoke run).
- `flexsp simulate --help` does the same as section 6 from the command line.
- Your own lengths: `get_distribution("my_lengths.txt")` (one integer per line, `.txt`, `.txt.gz` or `.npy`)."""),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


if __name__ == "__main__":
    path = Path(__file__).with_name("walkthrough.ipynb")
    nbformat.write(build(), path)
    print(f"wrote {path}")
