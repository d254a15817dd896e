"""Run by tests/data/test_prefetch.py in its own process: a script that ends while the loader's first
step is still being prepared (every read sleeps), in a gloo world of one with a pool, as a training
script does. Each finished read appends its index to the file named by argv[1]."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import cluster, cost_model, token_lists  # noqa: E402

from flexsp.data import FlexSPLoader, LoaderConfig  # noqa: E402
from flexsp.runtime import GroupPool, init_distributed  # noqa: E402


class SlowReads:
    def __init__(self, items: list[list[int]], log: str) -> None:
        self.items, self.log = items, log

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        time.sleep(0.1)
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return {"input_ids": self.items[i]}


init_distributed()
pool = GroupPool()
items = token_lists(32, high=60)
loader = FlexSPLoader(SlowReads(items, sys.argv[1]), cost_model(), cluster(1), LoaderConfig(batch_size=8, seed=0),
                      pool=pool, lengths=[len(x) for x in items])
loader.start()
print("leaving with the first step in preparation", flush=True)
