"""The loader in one process, standing in for each rank of a 4-GPU cluster in turn."""
import numpy as np
import pytest
from helpers import NUM_GPUS, cluster, cost_model, token_lists

torch = pytest.importorskip("torch")

from flexsp import PlanConfig
from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError  # noqa: E402
from flexsp.runtime.shard import pack
from flexsp.runtime.sp.context import IGNORE_INDEX

# greedy is deterministic, so four stand-in ranks solving alone agree; the 4-process tests use flexsp
CONFIG = LoaderConfig(batch_size=8, seed=3, plan=PlanConfig(strategy="greedy"))


def _steps(dataset, rank, config=CONFIG, **kwargs):
    with FlexSPLoader(dataset, cost_model(), cluster(), config, rank=rank, **kwargs) as loader:
        return list(loader), loader


def _summary(steps):
    """Everything a rank receives, as plain values."""
    return [(s.epoch, s.index, s.indices, s.plan.to_dict()["micro_batches"], s.num_tokens, s.loss_tokens,
             [(m.micro_batch, m.ranks, m.input_ids.tolist(), m.labels.tolist(), m.position_ids.tolist(),
               m.cu_seqlens.tolist(), m.indices) for m in s.micro_batches]) for s in steps]


def test_ranks_shards_reassemble_every_group_and_the_global_batch():
    data = token_lists(40, seed=1)
    per_rank = [_steps(data, r)[0] for r in range(NUM_GPUS)]
    assert len({len(steps) for steps in per_rank}) == 1
    seen = []
    for step_of_ranks in zip(*per_rank):
        plan = step_of_ranks[0].plan
        assert all(s.plan.micro_batches == plan.micro_batches and s.indices == step_of_ranks[0].indices for s in step_of_ranks)
        batch_tokens = []
        for m, mb in enumerate(plan.micro_batches):
            for g in mb.groups:
                shards = [next(x for x in step_of_ranks[r].micro_batches if x.micro_batch == m) for r in g.ranks]
                whole = pack([torch.tensor(data[step_of_ranks[0].indices[s]]) for s in g.seq_ids], g.degree)
                assert torch.equal(torch.cat([x.input_ids for x in shards]), whole.input_ids)
                assert torch.equal(torch.cat([x.labels for x in shards]), whole.labels)
                assert torch.equal(torch.cat([x.position_ids for x in shards]), whole.position_ids)
                batch_tokens += torch.cat([x.input_ids for x in shards])[:whole.real_tokens].tolist()
        # each rank got exactly the micro-batches the plan gives it
        for r, s in enumerate(step_of_ranks):
            assert [x.micro_batch for x in s.micro_batches] == [
                m for m, mb in enumerate(plan.micro_batches) if mb.group_of_rank(r) is not None]
        expected = [t for i in step_of_ranks[0].indices for t in data[i]]
        assert sorted(batch_tokens) == sorted(expected)
        assert step_of_ranks[0].num_tokens == len(expected)
        seen += step_of_ranks[0].indices
    assert sorted(seen) == list(range(40))


def test_hugging_face_dataset_gives_the_same_batches_as_a_list():
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed (pip install datasets)")
    data = token_lists(30, seed=2)
    plain = [_summary(_steps(data, r)[0]) for r in (0, 3)]
    hf = datasets.Dataset.from_dict({"input_ids": data})
    assert [_summary(_steps(hf, r)[0]) for r in (0, 3)] == plain
    with_column = hf.map(lambda row: {"length": len(row["input_ids"])})
    assert [_summary(_steps(with_column.with_format("torch"), r)[0]) for r in (0, 3)] == plain


@pytest.mark.parametrize("convert", [tuple, np.array, torch.tensor, lambda x: {"input_ids": x, "text": "-"}])
def test_item_formats_agree(convert):
    data = token_lists(16, seed=4)
    assert _summary(_steps([convert(x) for x in data], 1)[0]) == _summary(_steps(data, 1)[0])


def test_shards_carry_loss_normalisation_and_labels():
    data = token_lists(16, seed=5)
    steps, _ = _steps(data, 0)
    for s in steps:
        assert s.loss_tokens == sum(len(data[i]) - 1 for i in s.indices)
        for m in s.micro_batches:
            assert m.cu_seqlens.dtype == torch.int32 and m.cu_seqlens[-1] == sum(len(data[i]) for i in m.indices)
            assert (m.labels[m.real_tokens:] == IGNORE_INDEX).all()
            assert m.context().cu_seqlens is m.cu_seqlens   # the device tensor itself: no host copy


def test_resume_continues_with_the_next_unseen_batch_across_epochs():
    data = token_lists(30, seed=6)
    cfg = LoaderConfig(max_tokens=400, seed=1, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(data, cost_model(), cluster(), cfg) as full:
        reference = _summary(list(full) + list(full))           # two epochs
    with FlexSPLoader(data, cost_model(), cluster(), cfg) as first:
        head = []
        for step in first:
            head.append(step)
            if len(head) == 3:
                break
        state = first.state_dict()
    with FlexSPLoader(data, cost_model(), cluster(), cfg) as second:
        second.load_state_dict(state)
        tail = list(second) + list(second)
    assert _summary(head) + _summary(tail) == reference
    assert tail[0].step == 3


def test_state_from_other_settings_is_rejected():
    data = token_lists(10)
    state = FlexSPLoader(data, cost_model(), cluster(), CONFIG).state_dict()
    other = FlexSPLoader(data, cost_model(), cluster(), LoaderConfig(batch_size=4, seed=3, plan=PlanConfig(strategy="greedy")))
    with pytest.raises(LoaderError, match=r"batching settings differ .*'batch_size': \(8, 4\)"):
        other.load_state_dict(state)
    with pytest.raises(LoaderError, match="dataset of 10 sequences, this one has 9"):
        FlexSPLoader(data[:9], cost_model(), cluster(), CONFIG).load_state_dict(state)


def test_too_long_policy_error_and_skip():
    data = token_lists(12) + [list(range(300))]          # 300 tokens > 4 GPUs x 64
    with pytest.raises(LoaderError, match="failed on rank 0: LoaderError: dataset sequence 12 has 300 tokens"):
        _steps(data, 0)
    steps, loader = _steps(data, 0, LoaderConfig(batch_size=8, on_too_long="skip", plan=PlanConfig(strategy="greedy")))
    assert sorted(i for s in steps for i in s.indices) == list(range(12))
    assert loader.stats.skipped_too_long == 1


def test_stale_lengths_and_bad_items_are_named():
    data = token_lists(8)
    wrong = [len(x) for x in data]
    wrong[5] += 1
    errors = []
    for r in range(NUM_GPUS):   # only the ranks whose groups hold item 5 fetch it
        try:
            _steps(data, r, lengths=wrong)
        except LoaderError as exc:
            errors.append(str(exc))
    assert errors and all(f"dataset item 5 has {len(data[5])} tokens but its planned length is {wrong[5]}" in e
                          for e in errors)
    with pytest.raises(LoaderError, match=r"dataset item \d \(token ids\): must be a 1-D sequence of integers"):
        _steps([[0.5] * len(x) for x in data], 0, lengths=[len(x) for x in data])
    with pytest.raises(LoaderError, match="rank 4 is outside the cluster's ranks 0..3"):
        FlexSPLoader(data, cost_model(), cluster(), CONFIG, rank=4)


def test_custom_planner_error_reaches_the_loop():
    def broken(lengths):
        raise ValueError(f"no plan for {len(lengths)} sequences")

    with pytest.raises(LoaderError, match="batch 0 of epoch 0 failed on rank 0: ValueError: no plan for 8 sequences"):
        _steps(token_lists(16), 0, planner=broken)
