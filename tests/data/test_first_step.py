"""The first step does not wait for the planner process to start (issue 43, point 4).

A planner process that takes seconds to come up (``helpers.SlowStart``) stands in for an interpreter's
start on a busy host: the loader's first steps are planned in the loop's process meanwhile, with the plans
the process gives (the same deterministic solver on the same lengths), and ``start()`` prepares the first
step ahead, so a loop that builds its model after ``start()`` does not wait for it at all. A worker that
never comes up is replaced after its deadline, and past the restarts it is a named ``PlannerError``."""
import os
import threading
import time

import numpy as np
import pytest
from helpers import SlowStart, cluster, cost_model, token_lists

from flexsp import PlanConfig
from flexsp.data import AsyncPlanner, EpochBatches, FlexSPLoader, LoaderConfig, LoaderError, PlanBatch, PlannerError

START_S = 4.0   # the stand-in planner process's start: far longer than a step here
DATA = token_lists(48)
LENGTHS = np.array([len(x) for x in DATA])
SEARCH = PlanBatch(cost_model(), cluster(), PlanConfig(strategy="flexsp", time_limit=30.0))


def _structure(plan):
    return [[(g.ranks, g.seq_ids, g.ring) for g in mb.groups] for mb in plan.micro_batches]


def _worker_plans(n):
    """The first ``n`` batches' plans as the planner process makes them (every batch solved there)."""
    batches = EpochBatches(LENGTHS, LoaderConfig(batch_size=8, seed=0), capacity=256).iterate(0, 0)
    planner = AsyncPlanner(batches, LENGTHS, SlowStart(SEARCH, 0.0), lookahead=2, mode="process")
    try:
        assert planner.wait_ready()
        results = [planner.next() for _ in range(n)]
    finally:
        planner.close()
    assert all(r.plan.meta["pid"] != os.getpid() for r in results)
    return [(r.batch.indices, _structure(r.plan)) for r in results]


def test_the_first_steps_do_not_wait_for_a_slow_starting_planner_and_plan_as_it_would():
    config = LoaderConfig(batch_size=8, seed=0, lookahead=2, plan=PlanConfig(strategy="flexsp", time_limit=30.0))
    loader = FlexSPLoader(DATA, cost_model(), cluster(), config, planner=SlowStart(SEARCH, START_S))
    try:
        began = time.perf_counter()
        loader.start()
        assert time.perf_counter() - began < 0.5 * START_S   # start() does not wait for anything
        time.sleep(0.3)   # the model is built
        steps = []
        for step in loader:
            steps.append(step)
            if len(steps) == 3:
                break
        elapsed = time.perf_counter() - began
        assert loader._planner._backend.ready_at is None   # the worker was still starting: planned here meanwhile
    finally:
        loader.close()
    assert elapsed < 0.75 * START_S, elapsed   # waiting for the planner process would take START_S
    assert steps[0].plan_wait + steps[0].load_seconds < 0.25 * START_S
    assert not any(s.fallback for s in steps) and loader.stats.fallbacks == 0
    assert [(s.indices, _structure(s.plan)) for s in steps] == _worker_plans(3)   # the plans the process gives


def test_start_prepares_the_first_step_while_the_model_is_built():
    config = LoaderConfig(batch_size=8, seed=0, lookahead=2, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(DATA, cost_model(), cluster(), config) as loader:
        loader.start()
        deadline = time.perf_counter() + 30
        while not loader._ahead.done() and time.perf_counter() < deadline:
            time.sleep(0.01)   # the model is built (the loader thread prepares the first step meanwhile)
        first = next(iter(loader))
        assert loader._ahead is not None   # the next one is already preparing
    assert first.plan_wait + first.load_seconds < 0.05   # ready before the loop asked: nothing waited for
    assert loader.stats.prefetched == 1 and (first.epoch, first.index, first.step) == (0, 0, 0)


def test_a_planner_process_that_never_comes_up_is_replaced_then_a_named_error():
    batches = EpochBatches(LENGTHS, LoaderConfig(batch_size=4, seed=0), capacity=256).iterate(0, 0)
    planner = AsyncPlanner(batches, LENGTHS, SlowStart(SEARCH, 600.0), lookahead=2, fallback=SEARCH,
                           fallback_after=1.0, max_restarts=0, mode="process")
    try:
        began = time.perf_counter()
        with pytest.raises(PlannerError, match=r"did not answer within 1 s for global batch \d+ of epoch \d+"):
            while time.perf_counter() - began < 30:
                assert planner.next().plan is not None   # planned here while it "starts", for one deadline
        assert time.perf_counter() - began < 10   # one deadline to come up, one more waited for: then the error
    finally:
        planner.close(timeout=0.1)


class RecordsWarm:
    """A solver recording which thread warmed it and when, relative to its first plan."""

    def __init__(self, solve) -> None:
        self.solve, self.events = solve, []

    def warm(self) -> None:
        self.events.append(("warm", threading.current_thread().name))

    def __call__(self, lengths):
        self.events.append(("plan", threading.current_thread().name))
        return self.solve(lengths)


def test_start_warms_the_solver_on_the_calling_thread_before_the_first_plan():
    """The solver's first-call imports run where start() is called, not on the loader thread, where they
    waited for the training thread (a Trainer setting up: a plan of 12 ms of work took 0.4-0.5 s)."""
    solver = RecordsWarm(PlanBatch(cost_model(), cluster(), PlanConfig(strategy="greedy")))
    config = LoaderConfig(batch_size=8, seed=0, lookahead=0)
    with FlexSPLoader(DATA, cost_model(), cluster(), config, planner=solver) as loader:
        loader.start()
        next(iter(loader))
    assert solver.events[0] == ("warm", threading.current_thread().name)
    assert solver.events[1] == ("plan", "flexsp-loader-prefetch")


def test_the_warm_up_plans_once_a_process_and_never_raises(monkeypatch):
    """A second warm-up (the Trainer warms at construction, ``start()`` again) would plan a whole tiny batch,
    3.5-5 ms, in front of the first real plan: it does nothing."""
    import flexsp.plan.planner as planner
    from flexsp.data import planning
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("a warm-up's own failure")

    monkeypatch.setattr(planner, "plan_batch", failing)
    planning.warm_solver.cache_clear()
    try:
        PlanBatch(cost_model(), cluster(), PlanConfig(strategy="flexsp")).warm()   # does not raise
        PlanBatch(cost_model(), cluster(), PlanConfig(strategy="static", sp_degree=8)).warm()
        planning.warm_solver()
    finally:
        planning.warm_solver.cache_clear()
    assert len(calls) == 1


def test_start_can_wait_until_the_first_step_is_prepared():
    """``start(wait=True)``: the first step is ready when it returns, so the loop's first ``next()`` waits for
    nothing; a preparation that fails still raises in the first step, not in ``start``."""
    config = LoaderConfig(batch_size=8, seed=0, lookahead=2, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(DATA, cost_model(), cluster(), config) as loader:
        loader.start(wait=True)
        assert loader._ahead.done()
        loader.start(wait=True)   # again: nothing more to do
        first = next(iter(loader))
    assert first.plan_wait + first.load_seconds < 0.05 and loader.stats.prefetched == 1
    too_long = [list(range(1, 2000))] + DATA[1:]
    with FlexSPLoader(too_long, cost_model(), cluster(), config) as loader:
        loader.start(wait=True)
        with pytest.raises(LoaderError, match="too long"):
            next(iter(loader))
