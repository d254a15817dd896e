"""A short training job that forgets to clean up, run by ``test_exit.py`` under torchrun.

Ulysses and Ulysses x ring groups, three executors of which only the first is closed, and no
``dist.destroy_process_group()``: the runtime's own teardown at exit must leave every rank exiting 0.
With ``--check``, a handler registered before any runtime object (so it runs after the runtime's
teardown: atexit runs last-registered first) exits 3 if a failure watcher thread is still alive or
the world is still up at that point.
"""
import atexit
import os
import sys
import threading

import torch
import torch.distributed as dist


def _check_teardown() -> None:
    watchers = [t.name for t in threading.enumerate() if t.name.startswith("flexsp-failure-watch")]
    if watchers or dist.is_initialized():
        print(f"rank {os.environ.get('RANK')}: at exit, watchers alive {watchers}, world up {dist.is_initialized()}",
              flush=True)
        os._exit(3)


if "--check" in sys.argv:
    atexit.register(_check_teardown)

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime import GroupPool, StepExecutor, TinyLM, init_distributed  # noqa: E402

torch.set_num_threads(1)
init_distributed()
pool = GroupPool(splits=[(2, 2)])                 # degrees 1, 2, 4 and 4 as 2 (Ulysses) x 2 (ring)
torch.manual_seed(0)
model = TinyLM(ModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64))
executors = [StepExecutor(model, torch.optim.SGD(model.parameters(), lr=0.1), pool, failure_name=f"exit-job-{i}")
             for i in range(3)]
lengths = [9, 5, 7, 3]
batch = list((torch.arange(sum(lengths)) % 63 + 1).split(lengths))
plan = Plan(num_gpus=4, predicted_time=0.0, micro_batches=(
    MicroBatch((Group(ranks=(0, 1, 2, 3), seq_ids=(0, 1), ring=2),)),            # Ulysses x ring
    MicroBatch((Group(ranks=(0, 1), seq_ids=(2,)), Group(ranks=(2, 3), seq_ids=(3,)))),   # Ulysses
))
result = executors[0].run_plan(plan, batch)
executors[0].close()                              # the other two, the pool and the world are left open
# a file per rank, not a stdout line: four ranks' lines through one pipe can interleave
with open(f"rank{dist.get_rank()}.loss", "w") as out:
    out.write(f"{result.loss:.6f}\n")
