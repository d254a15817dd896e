"""The background planner: hides solves behind steps, stays within its look-ahead, reports errors, falls back."""
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import cluster, cost_model
from helpers import lengths as make_lengths

import flexsp
from flexsp.data import AsyncPlanner, EpochBatches, LoaderConfig, LoaderError

LENGTHS = np.array(make_lengths(80))


def _batches(batch_size=8):
    return EpochBatches(LENGTHS, LoaderConfig(batch_size=batch_size), capacity=256).iterate(0, 0)


def _greedy(lengths):
    return flexsp.plan_batch(lengths, cost_model(), cluster(), strategy="greedy")


def _slow(seconds, log=None):
    def solve(lengths):
        if log is not None:
            log.append(time.perf_counter())
        time.sleep(seconds)
        return _greedy(lengths)
    return solve


def test_solves_hide_behind_longer_steps_and_lookahead_holds():
    solve_s, step_s = 0.05, 0.12
    planner = AsyncPlanner(_batches(), LENGTHS, _slow(solve_s), lookahead=2)
    try:
        waits = []
        for _ in range(6):
            result = planner.next()
            assert result.plan is not None and result.error is None
            waits.append(planner.stats.last_wait)
            time.sleep(step_s)   # the training step
        assert max(waits[1:]) < 0.2 * solve_s, waits   # only the very first plan is waited for
        assert planner.stats.max_ahead <= 2
    finally:
        planner.close()


def test_lookahead_bound_holds_while_the_loop_is_stalled():
    log = []
    planner = AsyncPlanner(_batches(), LENGTHS, _slow(0.01, log), lookahead=3)
    try:
        planner.next()
        time.sleep(0.3)   # a long step: the thread may run ahead, but only 3 batches
        assert len(log) == 1 + 3
        assert planner.stats.max_ahead == 3
    finally:
        planner.close()


def test_slower_solver_than_step_still_runs_in_order():
    planner = AsyncPlanner(_batches(), LENGTHS, _slow(0.05), lookahead=1)
    try:
        keys = [planner.next().batch.key for _ in range(4)]
        assert keys == [(0, 0), (0, 1), (0, 2), (0, 3)]
        assert planner.stats.max_ahead <= 1 and planner.stats.wait_seconds > 0.1
    finally:
        planner.close()


def test_solver_exception_is_returned_not_lost():
    calls = []

    def fails_on_third(lengths):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("solver blew up")
        return _greedy(lengths)

    planner = AsyncPlanner(_batches(), LENGTHS, fails_on_third, lookahead=2)
    try:
        assert planner.next().plan is not None and planner.next().plan is not None
        bad = planner.next()
        assert bad.plan is None and bad.error == "RuntimeError: solver blew up" and bad.batch.key == (0, 2)
    finally:
        planner.close()


def test_plan_that_misses_a_sequence_is_an_error():
    def drops_one(lengths):
        return _greedy(lengths[:-1])

    planner = AsyncPlanner(_batches(), LENGTHS, drops_one, lookahead=0)
    result = planner.next()
    assert result.plan is None and "PlanError: sequences [7] are not planned" in result.error


def test_fallback_to_greedy_after_a_slow_solve():
    planner = AsyncPlanner(_batches(), LENGTHS, _slow(1.0), lookahead=1, fallback=_greedy, fallback_after=0.1)
    try:
        started = time.perf_counter()
        first = planner.next()
        assert first.fallback and first.plan is not None and first.batch.key == (0, 0)
        assert time.perf_counter() - started < 0.6
        assert planner.stats.fallbacks == 1
        second = planner.next()   # the late plan of batch 0 is discarded, not handed out twice
        assert second.batch.key == (0, 1)
    finally:
        planner.close()


def test_batching_error_surfaces_from_the_thread():
    eb = EpochBatches(np.array([10, 900]), LoaderConfig(batch_size=1), capacity=256)
    planner = AsyncPlanner(eb.iterate(0, 0), np.array([10, 900]), _greedy, lookahead=2)
    try:
        result = planner.next()
        assert result.batch is None and "sequence 1 has 900 tokens" in result.error
    finally:
        planner.close()


def test_close_does_not_wait_for_a_running_solve():
    planner = AsyncPlanner(_batches(), LENGTHS, _slow(2.0), lookahead=2)
    time.sleep(0.05)
    started = time.perf_counter()
    planner.close(timeout=0.2)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(LoaderError, match="planner thread has stopped"):
        AsyncPlanner(iter(()), LENGTHS, _greedy, lookahead=1).next()


def test_package_imports_without_torch():
    code = ("import sys; import flexsp, flexsp.data; from flexsp.data import LoaderConfig, AsyncPlanner; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
