"""A bad item, a failed plan or a hung rank on one of four gloo ranks reaches every rank as the same
``LoaderError`` within the loader's ``failure_timeout``; each test runs under a deadline and fails on it."""
import time

import pytest

torch = pytest.importorskip("torch")

from runtime.distributed import run_distributed  # noqa: E402

from fault.common import cost_model, dataset  # noqa: E402

WORLD, FAILURE_TIMEOUT, DEADLINE = 4, 3.0, 90   # DEADLINE: the whole launch, a fail-safe


class _Data:
    """The test dataset, except that one rank's read of one item fails or hangs."""

    def __init__(self, rank, bad_rank, bad_index, hang):
        self.items, self.rank, self.bad_rank, self.bad_index, self.hang = dataset(40), rank, bad_rank, bad_index, hang
        self.hung = False

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.rank == self.bad_rank and i in self.bad_index:
            if self.hang:
                if not self.hung:   # one slow read is enough: the others must not wait for it
                    self.hung = True
                    time.sleep(self.hang)
            else:
                raise OSError(f"disk read of item {i} failed")
        return self.items[i]


def _worker(rank, world, mode):
    import flexsp
    from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError
    from flexsp.runtime import GroupPool
    pool = GroupPool()
    lengths = [len(x) for x in dataset(40)]
    data = _Data(rank, 2, set(range(40)) if mode == "hang" else {3, 7, 11, 17, 23},
                 hang=8.0 if mode == "hang" else 0)
    calls = []

    def planner(batch_lengths):
        calls.append(1)
        if mode == "plan-hang" and len(calls) == 2:
            time.sleep(8.0)
        return flexsp.plan_batch(batch_lengths, cost_model(), flexsp.Cluster(world, world), strategy="greedy")

    config = LoaderConfig(batch_size=5, seed=1, lookahead=0, failure_timeout=FAILURE_TIMEOUT)
    started = time.monotonic()
    try:
        with FlexSPLoader(data, cost_model(), flexsp.Cluster(world, world), config, pool=pool, lengths=lengths,
                          planner=planner) as loader:
            for _ in loader:
                started = time.monotonic()   # time from the failing step's start
        return {"error": None}
    except LoaderError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started}


def _errors(mode):
    out = run_distributed(_worker, WORLD, mode, timeout=DEADLINE)
    assert all(o["error"] for o in out), out
    return out


def test_a_bad_item_on_one_rank_raises_the_same_error_everywhere():
    out = _errors("item")
    messages = {o["error"] for o in out}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("loading global batch ")
    assert "failed on rank 2: LoaderError: dataset item 7 could not be read: OSError: disk read of item 7" in message
    assert all(o["seconds"] < FAILURE_TIMEOUT for o in out)   # no rank waited for a timeout


def test_a_hung_item_read_stops_the_other_ranks_within_the_failure_timeout():
    out = _errors("hang")
    for rank, o in enumerate(out):
        if rank != 2:
            assert "not every rank arrived within 3 s" in o["error"], o
            assert FAILURE_TIMEOUT - 0.5 < o["seconds"] < FAILURE_TIMEOUT + 5, o


def test_a_hung_planner_stops_the_other_ranks_within_the_failure_timeout():
    out = _errors("plan-hang")
    for rank, o in enumerate(out[1:], start=1):
        assert "waiting for rank 0's plan of global batch 1 of epoch 0: not every rank arrived within 3 s" \
            in o["error"], o
        assert o["seconds"] < FAILURE_TIMEOUT + 5, o
