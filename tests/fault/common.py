"""Shared pieces of the fault tests: a tiny deterministic job (fp64 TinyLM, greedy plans, Adam) whose
training step is the current ``StepExecutor``; the glue is ``train_step``, one function to switch
when the executor takes loader steps directly."""
from __future__ import annotations

import numpy as np
import torch

import flexsp
from flexsp import PlanConfig
from flexsp.data import FlexSPLoader, LoaderConfig
from flexsp.plan.specs import ModelSpec
from flexsp.runtime import GroupPool, StepExecutor, TinyLM

VOCAB = 97
MODEL = ModelSpec(vocab=VOCAB, hidden=16, layers=1, heads=4, kv_heads=2, ffn=32, tie_embeddings=True)


def dataset(n: int = 48, seed: int = 0) -> list[list[int]]:
    """Item i's tokens start at a value of its own, so every item is recognisable."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.8, 0.8, n).astype(int) + 2, 2, 120)
    return [[(5 * i + t) % VOCAB for t in range(int(m))] for i, m in enumerate(lengths)]


def cost_model() -> flexsp.CostModel:
    return flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4, comm_bytes_per_token=1024,
                            alltoall_bandwidth={2: 1e9, 4: 5e8}, token_capacity=64,
                            meta={"sharding": "none"})   # the test job's model is replicated (unprepared)


def loader_config(lookahead: int = 0, batch_size: int = 6) -> LoaderConfig:
    # greedy plans are deterministic, so an interrupted and an uninterrupted run plan alike
    return LoaderConfig(batch_size=batch_size, seed=3, lookahead=lookahead, plan=PlanConfig(strategy="greedy"))


def build(world: int, data, *, lookahead: int = 0, pool: GroupPool | None = None, lr: float = 1e-2):
    """Model, optimizer, loader and executor of the test job, identical on every rank."""
    torch.manual_seed(0)
    model = TinyLM(MODEL).to(torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    pool = pool or GroupPool()
    loader = FlexSPLoader(data, cost_model(), flexsp.Cluster(world, world), loader_config(lookahead),
                          pool=pool if world > 1 else None)
    executor = StepExecutor(model, optimizer, pool, backend="sdpa")
    return model, optimizer, loader, executor


def train_step(executor: StepExecutor, step, data):
    """One optimizer step of a loader step: the runtime's one planned-step path."""
    return executor.step(step)


class SeenCounter:
    """How often each dataset item was trained, in the job's state: it rolls back with a checkpoint."""

    def __init__(self, n: int) -> None:
        self.counts = torch.zeros(n, dtype=torch.int64)

    def add(self, indices) -> None:
        for i in indices:
            self.counts[i] += 1

    def state_dict(self):
        return {"counts": self.counts}

    def load_state_dict(self, state) -> None:
        self.counts = state["counts"].clone()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
