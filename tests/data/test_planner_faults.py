"""A planner process that stalls or dies (issue 31, point 2; issue 38, point 5): a stopped worker (SIGSTOP)
costs one deadline and a fallback plan with a warning, never a hang, and is replaced, so the batches after
it come at the normal pace; a killed worker is restarted and its
batches come back identical to a synchronous solve; past ``max_restarts`` a named ``PlannerError``,
never a raw ``EOFError``/``BrokenPipeError``."""
import os
import signal
import time

import numpy as np
import pytest
from helpers import SlowSolver, cluster, cost_model, token_lists
from helpers import lengths as make_lengths

import flexsp
from flexsp import PlanConfig
from flexsp.data import AsyncPlanner, EpochBatches, FlexSPLoader, LoaderConfig, PlanBatch, PlannerError

LENGTHS = np.array(make_lengths(60))
GREEDY = PlanBatch(cost_model(), cluster(), PlanConfig(strategy="greedy"))


def _batches():
    return EpochBatches(LENGTHS, LoaderConfig(batch_size=8), capacity=256).iterate(0, 0)


def _worker(planner: AsyncPlanner) -> int:
    return planner._backend._process.pid


def _resume(pid: int) -> None:
    """SIGCONT a stopped worker, if the planner has not already killed it (it replaces one that misses its deadline)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _same(a: flexsp.Plan, b: flexsp.Plan) -> bool:
    return [[(g.ranks, g.seq_ids) for g in mb.groups] for mb in a.micro_batches] == \
           [[(g.ranks, g.seq_ids) for g in mb.groups] for mb in b.micro_batches]


def test_a_stopped_planner_costs_one_deadline_and_gives_the_fallback_plan():
    # a 2 s deadline: the replacement worker's own start (about 0.6 s idle, more under load) must fit in it, or
    # the next batch falls back too
    planner = AsyncPlanner(_batches(), LENGTHS, GREEDY, lookahead=2, fallback=GREEDY, fallback_after=2.0,
                           mode="process")
    assert planner.wait_ready()   # stopped once up (a worker still starting would not be waited for)
    pid = _worker(planner)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="did not answer within 2 s.*fallback"):
            results = [planner.next() for _ in range(3)]   # the worker may have answered the first two already
        assert time.perf_counter() - started < 15
        late = [r for r in results if r.fallback]
        assert len(late) == 1 and [r.batch.key for r in results] == [(0, 0), (0, 1), (0, 2)]
        assert _same(late[0].plan, GREEDY(LENGTHS[list(late[0].batch.indices)]))
        assert planner.stats.fallbacks == 1 and planner.stats.restarts == 1 and _worker(planner) != pid
    finally:
        _resume(pid)
        planner.close()


def test_a_killed_planner_is_restarted_and_its_plans_are_unchanged():
    planner = AsyncPlanner(_batches(), LENGTHS, GREEDY, lookahead=2, mode="process")
    try:
        first = planner.next()
        os.kill(_worker(planner), signal.SIGKILL)
        with pytest.warns(RuntimeWarning, match="killed by signal 9; restarting it"):
            rest = [planner.next() for _ in range(3)]
        assert planner.stats.restarts == 1 and planner.stats.fallbacks == 0
        for result in [first, *rest]:
            assert not result.fallback
            assert _same(result.plan, GREEDY(LENGTHS[list(result.batch.indices)]))
        assert [r.batch.index for r in [first, *rest]] == [0, 1, 2, 3]
    finally:
        planner.close()


def test_a_planner_that_keeps_dying_is_a_named_error():
    planner = AsyncPlanner(_batches(), LENGTHS, SlowSolver(exit_on=1), lookahead=1, max_restarts=2,
                           mode="process")
    try:
        assert planner.wait_ready()   # the worker, not this process, must make the call that ends it
        with pytest.warns(RuntimeWarning, match="restarting"):
            with pytest.raises(PlannerError, match=r"stopped unexpectedly \(.*exited with code 3\) after 2 restart"):
                planner.next()
    finally:
        planner.close()


def test_the_loader_falls_back_on_a_stopped_planner_and_counts_it_in_the_plan():
    data = token_lists(40)
    config = LoaderConfig(batch_size=8, lookahead=2, fallback_after=0.5, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(data, cost_model(), cluster(), config) as loader:
        loader.start()
        assert loader._planner.wait_ready()
        pid = _worker(loader._planner)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.warns(RuntimeWarning, match="fallback"):
                steps = iter(loader)
                while not (step := next(steps)).fallback:   # the worker may have answered a batch or two already
                    assert step.index < 3
            assert step.plan.meta["planner_fallbacks"] == 1
        finally:
            _resume(pid)


def test_a_planner_stopped_after_the_first_batch_costs_one_deadline_then_the_normal_pace():
    """Issue 38 point 5: a worker that missed its deadline is replaced, so only one batch waits for it."""
    deadline = 2.0   # one fresh worker's start (about 0.6 s here) fits well inside it
    planner = AsyncPlanner(_batches(), LENGTHS, GREEDY, lookahead=2, fallback=GREEDY, fallback_after=deadline,
                           mode="process")
    stopped = None
    try:
        assert planner.wait_ready()
        first = planner.next()
        assert not first.fallback
        stopped = _worker(planner)
        os.kill(stopped, signal.SIGSTOP)
        waits = []
        with pytest.warns(RuntimeWarning, match=r"did not answer within 2 s.*fallback.*replaced the process \(1 in a row"):
            for _ in range(6):
                started = time.perf_counter()
                result = planner.next()
                waits.append(time.perf_counter() - started)
                assert _same(result.plan, GREEDY(LENGTHS[list(result.batch.indices)]))
        assert planner.stats.fallbacks == 1 and planner.stats.restarts == 1   # before: a fallback per later batch
        assert _worker(planner) != stopped
        assert sum(waits) < 3 * deadline + 10, waits   # one deadline, one restart; before: 6 deadlines or so
    finally:
        if stopped is not None:
            _resume(stopped)
        planner.close()


def test_a_planner_that_keeps_missing_its_deadline_is_a_named_error():
    planner = AsyncPlanner(_batches(), LENGTHS, SlowSolver(60.0), lookahead=1, fallback=GREEDY, fallback_after=0.3,
                           max_restarts=1, mode="process")
    try:
        assert planner.wait_ready()
        with pytest.warns(RuntimeWarning, match="replaced the process"):
            assert planner.next().fallback
            with pytest.raises(PlannerError, match=r"did not answer within 0.3 s .* after 1 restart"):
                planner.next()
        assert planner.stats.restarts == 1
    finally:
        planner.close()


class _StallsNow:
    """Greedy plans at once, except its calls numbered ``slow`` (1-based), which take ``seconds``: the occasional
    stall of a long run (a paused host, swapping)."""

    def __init__(self, slow: set[int], seconds: float) -> None:
        self.slow, self.seconds, self.calls = slow, seconds, 0

    def __call__(self, lengths):
        self.calls += 1
        if self.calls in self.slow:
            time.sleep(self.seconds)
        return GREEDY(lengths)


def test_stalls_far_apart_are_survived_only_a_run_of_them_is_fatal():
    """The restart budget counts restarts in a row (no answer from a worker between them): a run with two stalls
    several batches apart keeps training (it died at its (max_restarts + 1)-th stall, however far apart)."""
    planner = AsyncPlanner(_batches(), LENGTHS, _StallsNow({2, 6}, 1.5), lookahead=1, fallback=GREEDY,
                           fallback_after=0.3, max_restarts=1, mode="thread")
    try:
        with pytest.warns(RuntimeWarning, match=r"replaced the thread \(1 in a row, at most 1\)"):
            results = [planner.next() for _ in range(8)]
        assert [r.batch.index for r in results] == list(range(8)) and all(r.plan is not None for r in results)
        assert planner.stats.fallbacks == 2 and planner.stats.restarts == 2
    finally:
        planner.close()


def test_a_fallback_deadline_of_zero_or_above_the_failure_timeout_is_refused():
    from flexsp.data import LoaderError
    with pytest.raises(LoaderError, match="fallback_after must be > 0"):
        LoaderConfig(batch_size=8, fallback_after=0)
    with pytest.raises(LoaderError, match=r"deadline \(38 s.* not below failure_timeout \(20 s\)"):
        LoaderConfig(batch_size=8, failure_timeout=20)
    LoaderConfig(batch_size=8, failure_timeout=20, lookahead=0)   # planned in the loop: no deadline to wait out


def test_a_solver_defined_in_the_script_being_run_is_planned_in_a_thread(monkeypatch):
    """A function of ``__main__`` pickles by name, but the spawned planner process cannot load it (its main module
    is not the script): "auto" plans it in a thread; "process" refuses it in one line. (It died at the first
    batch the worker solved, then after its restarts stopped the run.)"""
    import __main__

    from flexsp.data import LoaderError

    def my_planner(lengths):
        return GREEDY(lengths)
    my_planner.__module__, my_planner.__qualname__ = "__main__", "my_planner"
    monkeypatch.setattr(__main__, "my_planner", my_planner, raising=False)
    planner = AsyncPlanner(_batches(), LENGTHS, my_planner, lookahead=1)
    try:
        assert planner.mode == "thread" and planner.next().plan is not None
    finally:
        planner.close()
    with pytest.raises(LoaderError, match="a solver the planner process can load .* not of the script being run"):
        AsyncPlanner(_batches(), LENGTHS, my_planner, lookahead=1, mode="process")
