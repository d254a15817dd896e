"""Small datasets and cost models shared by the tests/data modules (imported as ``helpers``)."""
from __future__ import annotations

import numpy as np

import flexsp

VOCAB = 1000
NUM_GPUS = 4
TOKEN_CAPACITY = 64          # one GPU holds 64 tokens; the whole 4-GPU cluster 256


def cost_model(token_capacity: int = TOKEN_CAPACITY) -> flexsp.CostModel:
    return flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=1024,
                            alltoall_bandwidth={2: 1e9, 4: 5e8}, token_capacity=token_capacity)


def cluster(num_gpus: int = NUM_GPUS) -> flexsp.Cluster:
    return flexsp.Cluster(num_gpus=num_gpus, gpus_per_node=num_gpus)


def lengths(n: int, seed: int = 0, high: int = 250) -> list[int]:
    """Long-tailed lengths in [2, high]: most short, a few needing a group of 4."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(3.5, 1.0, n).astype(int) + 2, 2, high).tolist()


def token_lists(n: int, seed: int = 0, high: int = 250) -> list[list[int]]:
    """Item i counts up from its own start: every item's tokens are recognisable."""
    return [[(7 * i + t) % VOCAB for t in range(m)] for i, m in enumerate(lengths(n, seed, high))]


class SlowSolver:
    """A picklable solver (for the planner process): greedy plans after ``seconds`` of waiting, with
    the solving process's id in ``plan.meta``; ``fail_on`` raises on that call, ``exit_on`` kills
    the process there."""

    def __init__(self, seconds: float = 0.0, fail_on: int | None = None, exit_on: int | None = None) -> None:
        self.seconds, self.fail_on, self.exit_on, self.calls = seconds, fail_on, exit_on, 0

    def __call__(self, lengths):
        import dataclasses
        import os
        import time
        self.calls += 1
        if self.calls == self.exit_on:
            os._exit(3)
        if self.calls == self.fail_on:
            raise RuntimeError("solver blew up")
        time.sleep(self.seconds)
        plan = flexsp.plan_batch(lengths, cost_model(), cluster(), strategy="greedy")
        return dataclasses.replace(plan, meta={"pid": os.getpid()})


class SlowStart:
    """A picklable solver whose planner process is slow to come up: unpickling it (which only the planner
    process does, before it says it is up) sleeps ``start_seconds``, standing in for an interpreter's start
    on a busy host. It plans with ``solve`` (the same plan wherever it runs) and records where in ``meta``."""

    def __init__(self, solve, start_seconds: float) -> None:
        self.solve, self.start_seconds = solve, start_seconds

    def __setstate__(self, state: dict) -> None:
        import time
        time.sleep(state["start_seconds"])
        self.__dict__.update(state)

    def __call__(self, lengths):
        import dataclasses
        import os
        plan = self.solve(lengths)
        return dataclasses.replace(plan, meta={**plan.meta, "pid": os.getpid()})
