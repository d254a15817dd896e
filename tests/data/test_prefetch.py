"""The loader prepares the next step while the current one trains (issue 36, points 4 and 5).

A dataset whose items take a while to read (each ``__getitem__`` sleeps, so a batch takes about as long
to prepare as a step takes to train) and a step that sleeps as long: with prefetching, the reads of
batch k+1 begin before step k ends (recorded events, not wall-clock thresholds) and the loop hardly
waits; without it, every batch is read after the previous step, and the loop waits about half its time.
The position handed out (``state_dict``) is the loop's, not the preparation's."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import cost_model, token_lists
from runtime.distributed import free_port

import flexsp
from flexsp import PlanConfig
from flexsp.data import FlexSPLoader, LoaderConfig

BATCH, READ_S, STEPS = 4, 0.05, 5
STEP_S = BATCH * READ_S   # the step trains as long as its batch takes to read


class SlowReads:
    """Token lists whose every read sleeps ``READ_S`` and is recorded as (start time, index)."""

    def __init__(self, n: int) -> None:
        self.items = token_lists(n)
        self.reads: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        with self._lock:
            self.reads.append((time.perf_counter(), int(i)))
        time.sleep(READ_S)
        return self.items[i]


def _train(prefetch: bool):
    data = SlowReads(40)
    config = LoaderConfig(batch_size=BATCH, seed=0, lookahead=2, prefetch=prefetch,
                          plan=PlanConfig(strategy="greedy"))
    # one GPU that holds every sequence: each batch is one degree-1 group, all of it read by rank 0
    cluster, cost = flexsp.Cluster(num_gpus=1, gpus_per_node=1), cost_model(token_capacity=4096)
    # plans made ahead on a thread of this process (a lambda does not pickle), so a planner process
    # starved of CPU on a loaded machine cannot delay the reads this test is about
    planner = lambda lengths: flexsp.plan_batch(lengths, cost, cluster, strategy="greedy")   # noqa: E731
    steps, spans = [], []
    with FlexSPLoader(data, cost, cluster, config, lengths=[len(x) for x in data.items], planner=planner) as loader:
        loader.start()
        for step in loader:
            began = time.perf_counter()
            time.sleep(STEP_S)   # the training step
            spans.append((began, time.perf_counter()))
            steps.append(step)
            if len(steps) == STEPS:
                state = loader.state_dict()
                break
        stats = loader.stats
    first_read = {}
    for at, i in data.reads:
        first_read.setdefault(i, at)
    return steps, spans, first_read, state, stats


def test_the_next_batch_is_read_while_the_step_trains():
    steps, spans, first_read, state, stats = _train(prefetch=True)
    for k in range(STEPS - 1):
        nxt = min(first_read[i] for i in steps[k + 1].indices)
        assert nxt < spans[k][1], f"batch {k + 1} was read only after step {k} ended"
    # the loop's own wait after the first step (generous: a sleeping step leaves the loader thread the CPU)
    loop = spans[-1][1] - spans[1][0]
    waited = sum(s.plan_wait + s.load_seconds for s in steps[1:])
    assert waited < 0.25 * loop, (waited, loop)
    assert stats.prefetched == STEPS and stats.steps == STEPS   # start() set the first step preparing too
    assert stats.prepare_load_seconds >= STEPS * BATCH * READ_S * 0.9   # the reads happened, off the loop
    assert (state["index"], state["step"]) == (STEPS, STEPS)   # the loop's position, not the prepared one


def test_without_prefetch_each_batch_is_read_after_the_previous_step():
    steps, spans, first_read, state, stats = _train(prefetch=False)
    for k in range(STEPS - 1):
        assert min(first_read[i] for i in steps[k + 1].indices) > spans[k][1]
    waited = sum(s.plan_wait + s.load_seconds for s in steps[1:])
    assert waited >= (STEPS - 1) * BATCH * READ_S * 0.9   # every read is waited for
    assert stats.prefetched == 0 and (state["index"], state["step"]) == (STEPS, STEPS)


def test_a_resumed_loader_continues_at_the_loops_position_not_the_prepared_one():
    data = token_lists(40)
    config = LoaderConfig(batch_size=BATCH, seed=0, plan=PlanConfig(strategy="greedy"))
    cluster = flexsp.Cluster(num_gpus=1, gpus_per_node=1)
    cost = cost_model(token_capacity=4096)
    with FlexSPLoader(data, cost, cluster, config) as loader:
        it = iter(loader)
        seen = [next(it).indices for _ in range(3)]
        state = loader.state_dict()
        rest = [next(it).indices for _ in range(2)]
    with FlexSPLoader(data, cost, cluster, config) as resumed:
        resumed.load_state_dict(state)
        it = iter(resumed)
        assert [next(it).indices for _ in range(2)] == rest
    assert len(set(seen + rest)) == 5


@pytest.mark.parametrize("value", [1, "yes", None])
def test_prefetch_setting_is_a_bool(value):
    with pytest.raises(flexsp.data.LoaderError, match="prefetch must be True or False"):
        LoaderConfig(batch_size=4, prefetch=value)


def test_a_script_ending_mid_preparation_exits_cleanly_after_it(tmp_path):
    """A script may end while the loader thread still prepares a step; left to interpreter shutdown, that
    aborted the process now and then ("terminate called without an active exception": the thread was
    importing the solver as the world went down). The loader closes at exit: the step's eight reads finish
    first, then the process exits with 0."""
    log = tmp_path / "reads.txt"
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "exit_while_preparing.py"), str(log)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "leaving" in proc.stdout
    assert len(log.read_text().split()) == 8   # the whole first batch was read before the exit


def test_the_exit_handler_does_not_wait_past_its_bound_for_a_stuck_preparation(monkeypatch, caplog):
    """A read that never returns (a peer gone, a hung file system) must not hold a failing job's exit for
    ``failure_timeout``: the handler waits ``EXIT_WAIT_S``, warns and leaves the preparation as it is."""
    import weakref

    from flexsp.data import loader as loader_module
    release = threading.Event()

    class StuckReads(SlowReads):
        def __getitem__(self, i):
            release.wait(30)
            return super().__getitem__(i)

    monkeypatch.setattr(loader_module, "EXIT_WAIT_S", 0.2)
    data = StuckReads(16)
    loader = FlexSPLoader(data, cost_model(), flexsp.Cluster(4, 4), LoaderConfig(batch_size=BATCH, seed=0),
                          lengths=[len(x) for x in data.items])   # only the loader thread's reads get stuck
    try:
        loader.start()
        began = time.perf_counter()
        with caplog.at_level("WARNING", logger="flexsp.loader"):
            loader_module._close_at_exit(weakref.ref(loader))
        assert time.perf_counter() - began < 5
        assert "still being prepared 0.2 s into the exit" in caplog.text
    finally:
        release.set()
        loader.close()
