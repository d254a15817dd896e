"""The background planner: hides solves behind steps, stays within its look-ahead, reports errors, falls
back; in a spawned process (plans identical to synchronous ones, packed compactly) or a thread."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import SlowSolver, cluster, cost_model
from helpers import lengths as make_lengths

import flexsp
from flexsp import PlanConfig
from flexsp.data import AsyncPlanner, EpochBatches, LoaderConfig, LoaderError, PlanBatch
from flexsp.data.planning import pack_plan, unpack_plan

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
    with pytest.raises(LoaderError, match="planner process has stopped"):
        AsyncPlanner(iter(()), LENGTHS, _greedy, lookahead=1).next()   # and no process was started for it


def test_package_imports_without_torch():
    code = ("import sys; import flexsp, flexsp.data; from flexsp.data import LoaderConfig, AsyncPlanner; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------ the planner process

def test_process_plans_equal_synchronous_plans_in_order():
    solve = PlanBatch(cost_model(), cluster(), PlanConfig(strategy="greedy"))
    sync = AsyncPlanner(_batches(), LENGTHS, solve, lookahead=0)
    expected = [sync.next() for _ in range(5)]
    planner = AsyncPlanner(_batches(), LENGTHS, solve, lookahead=2)
    try:
        assert planner.mode == "process"
        got = [planner.next() for _ in range(5)]
        assert [r.batch.key for r in got] == [r.batch.key for r in expected]
        for a, b in zip(got, expected):
            assert a.plan.micro_batches == b.plan.micro_batches and a.plan.predicted_time == b.plan.predicted_time
        assert planner.stats.max_ahead <= 2 and planner.stats.solved == 5
    finally:
        planner.close()


def test_process_solves_elsewhere_reports_errors_and_falls_back():
    planner = AsyncPlanner(_batches(), LENGTHS, SlowSolver(0.0, fail_on=3), lookahead=2)
    try:
        assert planner.wait_ready()   # else the loop plans the first batch itself (see the next test)
        first = planner.next()
        assert first.plan.meta["pid"] != os.getpid()   # solved in the planner process
        assert planner.next().plan is not None
        bad = planner.next()
        assert bad.plan is None and bad.error == "RuntimeError: solver blew up" and bad.batch.key == (0, 2)
        assert isinstance(bad.exception, RuntimeError)
    finally:
        planner.close()
    slow = AsyncPlanner(_batches(), LENGTHS, SlowSolver(5.0), lookahead=1, fallback=_greedy, fallback_after=0.2)
    try:
        assert slow.wait_ready()
        result = slow.next()
        assert result.fallback and result.plan is not None and result.batch.key == (0, 0)
        started = time.perf_counter()
    finally:
        slow.close(timeout=0.2)   # a solve is running: the process is terminated, not waited for
    assert time.perf_counter() - started < 2.0


def test_a_dead_planner_process_is_an_error_not_a_hang():
    planner = AsyncPlanner(_batches(), LENGTHS, SlowSolver(exit_on=2), lookahead=1, max_restarts=0)
    try:
        assert planner.wait_ready()   # the worker, not this process, must make the calls that end it
        assert planner.next().plan is not None
        with pytest.raises(LoaderError, match=r"planner process stopped unexpectedly \(.*exited with code 3"):
            planner.next()
    finally:
        planner.close()


def test_the_first_batch_does_not_wait_for_the_worker_to_start():
    """The loop plans the batches due while the worker starts (an interpreter and its imports) itself; the
    worker skips them and plans the rest once it is up."""
    planner = AsyncPlanner(_batches(), LENGTHS, SlowSolver(0.0), lookahead=2, mode="process")
    try:
        results = [planner.next() for _ in range(2)]
        assert results[0].plan.meta["pid"] == os.getpid()   # planned here: the worker was not up yet
        assert planner.wait_ready()
        results += [planner.next() for _ in range(2)]
        assert all(r.plan.meta["pid"] not in (None, os.getpid()) for r in results[2:])
        assert [r.batch.key for r in results] == [(0, 0), (0, 1), (0, 2), (0, 3)]
        assert planner.stats.fallbacks == 0 and planner.stats.restarts == 0
    finally:
        planner.close()


def test_process_mode_needs_a_picklable_solver():
    with pytest.raises(LoaderError, match="picklable"):
        AsyncPlanner(_batches(), LENGTHS, lambda lengths: _greedy(lengths), lookahead=1, mode="process")
    with pytest.raises(LoaderError, match="mode"):
        AsyncPlanner(_batches(), LENGTHS, _greedy, mode="fork")
    assert AsyncPlanner(_batches(), LENGTHS, lambda lengths: _greedy(lengths), lookahead=1).mode == "thread"


def test_packed_plans_round_trip_compactly():
    import pickle
    lengths = np.random.default_rng(0).integers(2, 60, 400)
    plan = flexsp.plan_batch(lengths, cost_model(), cluster(), strategy="batchada")
    packed = pack_plan(plan)
    back = unpack_plan(packed)
    assert back == plan and back.to_dict() == plan.to_dict()
    parsed = flexsp.Plan.from_json(plan.to_json())            # groups as Group tuples, not plan_batch's columns
    assert unpack_plan(pack_plan(parsed)) == plan and pack_plan(parsed)["seq_ids"].tolist() == packed["seq_ids"].tolist()
    assert len(pickle.dumps(packed)) < 0.5 * len(pickle.dumps(plan))
    scattered = flexsp.Plan(8, (flexsp.MicroBatch((flexsp.Group((5, 1), (1, 0)), flexsp.Group((0,), ()))),), 1.0)
    assert unpack_plan(pack_plan(scattered)) == scattered   # any ranks, even empty groups
