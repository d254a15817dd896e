"""Per-token supervision (``labels``, TRL's ``completion_mask`` / ``assistant_masks``) under a heterogeneous
plan on 4 gloo ranks (fp64: degrees 1, 2 and 4, a 2 x 2 ring group, idle ranks, groups with no supervised
target) equals one device computing Hugging Face's loss: the sum over supervised targets divided by their
count in the global batch. Both entry points: ``StepExecutor.run_plan`` and the ``FlexSPLoader``'s step."""
import logging
import math

import numpy as np

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import flexsp  # noqa: E402
from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.plan.config import PlanConfig  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

from .distributed import run_distributed  # noqa: E402

VOCAB = 64
CFG = dict(vocab=VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, tie_embeddings=False)
LENGTHS = [21, 9, 14, 5, 11, 17, 3, 8, 12, 6]


def _rows(seed: int, masked_all: bool = False) -> list:
    """Rows of every kind: labels (prompt -100, then ids that are NOT the row's tokens), completion masks,
    assistant masks (two assistant turns), plain tensors, a row with every label -100."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(1, VOCAB, (n,), generator=gen)
        half = n // 2
        kind = i % 5
        if masked_all or i == 6:
            rows.append({"input_ids": ids, "labels": torch.full((n,), -100)})
        elif kind == 0:
            labels = torch.randint(0, VOCAB, (n,), generator=gen)      # any values, not copies of input_ids
            labels[:half] = -100
            rows.append({"input_ids": ids, "labels": labels})
        elif kind == 1:
            rows.append({"input_ids": ids, "completion_mask": [0] * half + [1] * (n - half)})
        elif kind == 2:
            mask = [0] * n
            for a, b in ((2, 5), (n - 4, n - 1)):
                mask[a:b] = [1] * (b - a)
            rows.append({"input_ids": ids, "assistant_masks": mask})
        elif kind == 3:
            rows.append(ids)                                            # plain: every next token
        else:
            labels = ids.clone()
            labels[: n - 3] = -100                                      # labels that agree with a mask
            rows.append({"input_ids": ids, "labels": labels, "completion_mask": (labels != -100).long().tolist()})
    return rows


def _targets(row) -> torch.Tensor:
    """What HF trains on, written independently of flexsp: labels, or input_ids where the mask is 1."""
    if isinstance(row, torch.Tensor):
        return row
    ids = row["input_ids"]
    if "labels" in row:
        return row["labels"]
    mask = torch.as_tensor(row.get("completion_mask", row.get("assistant_masks")))
    return torch.where(mask == 1, ids, torch.full_like(ids, -100))


def _model():
    torch.manual_seed(5)
    return TinyLM(ModelSpec(**CFG)).double()


def _reference(batches):
    """One device, HF's loss: sum of CE over shifted supervised targets / their count (no packing)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for rows in batches:
        opt.zero_grad()
        total, count = 0.0, 0
        for row in rows:
            ids = row if isinstance(row, torch.Tensor) else row["input_ids"]
            target = _targets(row)[1:]
            total = total + F.cross_entropy(model(ids)[:-1], target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
        loss = total / max(count, 1)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), losses


def _all_tokens_reference(rows):
    """Today's behaviour (every next token a target): what the tests must tell apart from HF's loss."""
    model = _model()
    total = sum(F.cross_entropy(model(r if isinstance(r, torch.Tensor) else r["input_ids"])[:-1],
                                (r if isinstance(r, torch.Tensor) else r["input_ids"])[1:], reduction="sum")
                for r in rows)
    return float(total.detach()) / sum(n - 1 for n in LENGTHS)


def _plan():
    mb = lambda *groups: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                          for r, s, ring in groups))
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=(
        mb((range(4), (0, 1), 2)),                                     # 2 x 2 ring: zigzag labels
        mb(((0, 1), (5,), 1), ((2,), (3,), 1), ((3,), (7,), 1)),  # degree 2: a supervised target at the shard cut
        mb(((0, 1, 2, 3), (2, 8, 9), 1)),                              # degree 4
        mb(((2, 3), (6,), 1), ((0,), (4,), 1)),                        # a group with no supervised target; rank 1 idles
    ))


def _fixed_planner(lengths):
    """The loader's planner: the same heterogeneous plan with its ring group, whatever order it shuffled to."""
    return _plan()


def _worker(rank, world_size, plan, seeds, with_loader):
    pool = GroupPool(splits=[(2, 2)])
    model = _model()
    executor = StepExecutor(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), pool,
                            backend="sdpa", failure_name="supervision")
    results = [executor.run_plan(Plan.from_dict(plan), _rows(seed)) for seed in seeds]
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("flexsp.step").addHandler(handler)
    zero = executor.run_plan(Plan.from_dict(plan), _rows(0, masked_all=True))
    logging.getLogger("flexsp.step").removeHandler(handler)
    out = {"params": torch.nn.utils.parameters_to_vector(model.parameters()).detach(), "results": results,
           "zero": zero, "logged": logged}
    if with_loader:
        from flexsp.data import FlexSPLoader, LoaderConfig
        cost = flexsp.CostModel(alpha1=1e-6, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1e3,
                                alltoall_bandwidth={2: 1e9, 4: 1e9}, token_capacity=64, meta={"sharding": "none"})
        rows = _rows(seeds[0])
        loader = FlexSPLoader(rows, cost, flexsp.Cluster(num_gpus=4, gpus_per_node=4), pool=pool, lengths=LENGTHS,
                              vocab_size=VOCAB, planner=_fixed_planner, config=LoaderConfig(batch_size=len(LENGTHS), seed=3, lookahead=0,
                                                                    plan=PlanConfig(time_limit=1.0)))
        step = next(iter(loader))
        loader.close()
        assert step.indices != tuple(range(len(LENGTHS)))   # shuffled: labels must follow their rows
        loaded = _model()
        result = StepExecutor(loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1), pool,
                              backend="sdpa", failure_name="supervision-loader").step(step)
        bad = _rows(seeds[0])
        bad[4] = {"input_ids": bad[4]["input_ids"], "labels": [-100] * 5 + [VOCAB] + [1] * (LENGTHS[4] - 6)}
        loader = FlexSPLoader(bad, cost, flexsp.Cluster(num_gpus=4, gpus_per_node=4), pool=pool, lengths=LENGTHS,
                              vocab_size=VOCAB, planner=_fixed_planner,
                              config=LoaderConfig(batch_size=len(LENGTHS), seed=3, lookahead=0, prefetch=False))
        try:   # only the rank holding item 4 reads it; the load agreement makes it every rank's error
            next(iter(loader))
            out["bad_row"] = None
        except Exception as exc:
            out["bad_row"] = f"{type(exc).__name__}: {exc}"
        loader.close()
        out.update(loader_params=torch.nn.utils.parameters_to_vector(loaded.parameters()).detach(),
                   loader_result=result, loader_rings=sorted({g.ring for mb in step.plan.micro_batches
                                                              for g in mb.groups}))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, 4, _plan().to_dict(), [0, 1], True, timeout=150)


def test_supervised_loss_and_update_equal_one_device(runs):
    _, losses = _reference([_rows(0), _rows(1)])
    for run in runs:
        assert [r.loss for r in run["results"]] == pytest.approx(losses, rel=1e-12)
    supervised = sum(int((_targets(r)[1:] != -100).sum()) for r in _rows(0))
    assert {run["results"][0].loss_tokens for run in runs} == {supervised}
    assert supervised < sum(n - 1 for n in LENGTHS) // 2 + 10   # the prompts really are masked
    # the all-token loss is what the old code computed: a different number
    assert abs(_all_tokens_reference(_rows(0)) - losses[0]) > 1e-3 * losses[0]


def test_update_equals_one_device_including_a_zero_supervision_step(runs):
    # two steps, then the all-masked one: zero gradients (AdamW still moves on its momentum, as on one device)
    model_want, _ = _reference([_rows(0), _rows(1), _rows(0, masked_all=True)])
    for run in runs:
        assert abs(run["params"] - model_want).max() < 1e-10
        assert run["zero"].loss == 0.0 and run["zero"].loss_tokens == 0 and math.isfinite(run["zero"].loss)
        assert run["logged"] == ["step 2: the global batch has no supervised target (every label -100 or masked): "
                                 "a zero-loss step, zero gradients"]
        assert np.isfinite(run["params"]).all()
    plain, _ = _reference([[r if isinstance(r, torch.Tensor) else r["input_ids"] for r in _rows(0)]])
    once, _ = _reference([_rows(0)])
    assert abs(plain - once).max() > 1e-4     # supervising every token would be a different update


def test_loader_step_equals_one_device(runs):
    want, losses = _reference([_rows(0)])
    for run in runs:
        assert abs(run["loader_params"] - want).max() < 1e-10
        assert run["loader_result"].loss == pytest.approx(losses[0], rel=1e-12)
        assert run["loader_result"].loss_tokens == runs[0]["results"][0].loss_tokens
    assert runs[0]["loader_rings"] == [1, 2]   # the loader ran the ring group too


def test_a_bad_row_on_one_rank_is_every_ranks_error_naming_row_and_column(runs):
    errors = {run["bad_row"] for run in runs}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("LoaderError: loading global batch 0 of epoch 0 failed on rank ")
    assert "dataset item 4, column 'labels': position 5 holds 64, outside the vocabulary 0..63" in error
    assert "\n" not in error
