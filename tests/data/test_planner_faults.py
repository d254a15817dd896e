"""A planner process that stalls or dies (issue 31, point 2): a stopped worker (SIGSTOP) costs one
deadline and a fallback plan with a warning, never a hang; a killed worker is restarted and its
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


def _same(a: flexsp.Plan, b: flexsp.Plan) -> bool:
    return [[(g.ranks, g.seq_ids) for g in mb.groups] for mb in a.micro_batches] == \
           [[(g.ranks, g.seq_ids) for g in mb.groups] for mb in b.micro_batches]


def test_a_stopped_planner_costs_one_deadline_and_gives_the_fallback_plan():
    planner = AsyncPlanner(_batches(), LENGTHS, GREEDY, lookahead=2, fallback=GREEDY, fallback_after=0.5,
                           mode="process")
    pid = _worker(planner)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="did not answer within 0.5 s.*fallback"):
            first = planner.next()
        assert time.perf_counter() - started < 10
        assert first.fallback and first.batch.key == (0, 0)
        assert _same(first.plan, GREEDY(LENGTHS[list(first.batch.indices)]))
        assert planner.stats.fallbacks == 1
    finally:
        os.kill(pid, signal.SIGCONT)
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
        pid = _worker(loader._planner)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.warns(RuntimeWarning, match="fallback"):
                step = next(iter(loader))
            assert step.fallback and step.plan.meta["planner_fallbacks"] == 1
        finally:
            os.kill(pid, signal.SIGCONT)
