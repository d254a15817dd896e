"""A row's supervision (``flexsp.runtime.labels``) and where its labels land: every layout (Ulysses packing at
any degree, the zigzag order of any Ulysses x ring split, padding rows) gives each token the target of the
next token of its own sequence, whichever rank holds it; bad columns are one-line errors naming row and column."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flexsp.plan.types import Group  # noqa: E402
from flexsp.runtime.labels import LabelsError, read_targets  # noqa: E402
from flexsp.runtime.shard import group_inputs, pack  # noqa: E402
from flexsp.runtime.sp.tokens import IGNORE_INDEX  # noqa: E402

I = IGNORE_INDEX


def _expected(rows):
    """token id -> the label it must carry (ids are unique over the batch), written without flexsp."""
    want = {}
    for ids, targets in rows:
        t = ids if targets is None else targets
        for k in range(len(ids)):
            want[int(ids[k])] = int(t[k + 1]) if k + 1 < len(ids) else I
    return want


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5), split=st.sampled_from(
    [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (1, 4), (3, 2)]), seed=st.integers(0, 99))
def test_every_token_keeps_its_label_in_every_layout(lengths, split, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randperm(sum(lengths), generator=gen) + 1).split(lengths)
    rows = []
    for i, seq in enumerate(ids):
        if i % 3 == 0:
            rows.append((seq, None))
        else:
            t = torch.randint(0, 500, (seq.numel(),), generator=gen)
            t[torch.rand(seq.numel(), generator=gen) < 0.4] = I
            rows.append((seq, t))
    ulysses, ring = split
    group = Group(ranks=tuple(range(ulysses * ring)), seq_ids=tuple(range(len(rows))), ring=ring)
    want, seen = _expected(rows), {}
    for rank in group.ranks:
        shard, _ = group_inputs(group, [r[0] for r in rows], rank, "cpu", targets=[r[1] for r in rows])
        for tok, lab in zip(shard.input_ids.tolist(), shard.labels.tolist()):
            if tok in want:
                assert tok not in seen
                seen[tok] = lab
            else:
                assert lab == I   # padding rows carry no loss
    assert seen == want


def test_pack_labels_against_hand_written():
    p = pack([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], 3, targets=[torch.tensor([I, 9, I]), None])
    assert p.labels.tolist() == [9, I, I, 5, I, I]


def _read(columns, n=6, vocab=50):
    return read_targets(columns, torch.arange(1, n + 1), "dataset item 7", vocab)


def test_masks_and_labels_become_targets():
    t, n = _read({"completion_mask": [0, 0, 0, 1, 1, 1]})
    assert t.tolist() == [I, I, I, 4, 5, 6] and n == 3
    t, n = _read({"completion_mask": [0, 1, 1, 1, 1, 1], "assistant_masks": [1, 1, 0, 0, 1, 1]})   # both apply
    assert t.tolist() == [I, 2, I, I, 5, 6] and n == 3
    t, n = _read({"labels": [I, 40, 41, I, I, 3]})        # any ids, not copies of input_ids
    assert t.tolist() == [I, 40, 41, I, I, 3] and n == 3
    t, n = _read({"labels": [0, I, I, I, I, I]})          # the first token is never predicted
    assert n == 0
    t, n = _read({"labels": [1, I, 3, 4, 5, 6], "completion_mask": [0, 0, 1, 1, 1, 1]})   # position 0: no target
    assert t.tolist() == [I, I, 3, 4, 5, 6] and n == 4
    assert _read({}) == (None, 5)


@pytest.mark.parametrize("columns,message", [
    ({"labels": [1, 2, 3]}, "dataset item 7, column 'labels': 3 entries but input_ids has 6"),
    ({"completion_mask": [1] * 7}, "dataset item 7, column 'completion_mask': 7 entries but input_ids has 6"),
    ({"assistant_masks": [0, 1, 2, 1, 0, 1]}, "dataset item 7, column 'assistant_masks': position 2 holds 2; "
                                               "a loss mask holds 0 or 1"),
    ({"labels": [I, 3, 50, 1, 1, 1]}, "dataset item 7, column 'labels': position 2 holds 50, outside the "
                                      "vocabulary 0..49"),
    ({"labels": [I, -5, 1, 1, 1, 1]}, "position 1 holds -5"),
    ({"labels": [I, I, 3, 4, 5, 6], "completion_mask": [0, 1, 1, 1, 1, 1]},
     "dataset item 7: columns 'labels' and 'completion_mask' disagree at position 1 \\(label -100, mask 1\\)"),
    ({"labels": [[1, 2]] * 6}, "column 'labels': must be a 1-D sequence of integers"),
    ({"completion_mask": [0.5] * 6}, "column 'completion_mask': must be a 1-D sequence of integers"),
    # found by fuzzing: each of these used to change the loss silently
    ({"labels": [False, True, True, True, True, True]}, "column 'labels': must be a 1-D sequence of integers, "
                                                       "got shape \\(6,\\) dtype torch.bool"),
    ({"labels": np.array([2**64 - 100, 3, 4, 5, 6, 7], dtype=np.uint64)}, "column 'labels': holds a value above"),
    ({"labels": torch.ones(6, dtype=torch.long, device="meta")}, "column 'labels': a meta tensor holds no values"),
    ({"label": [I, 2, 3, 4, 5, 6]}, "column 'label' is as long as input_ids but FlexSP reads 'labels'"),
    ({"completion_masks": [0, 0, 1, 1, 1, 1]}, "column 'completion_masks' is as long as input_ids but FlexSP reads "
                                               "'completion_mask'"),
    ({"assistant_mask": [0, 0, 1, 1, 1, 1]}, "column 'assistant_mask' is as long as input_ids"),
    ({"attention_mask": [1, 1, 1, 1, 0, 0]}, "column 'attention_mask' is 0 at position 4: FlexSP packs sequences "
                                             "unpadded"),
    ({"label_ids": [I, 2, 3, 60, 5, 6]}, "column 'label_ids': position 3 holds 60, outside the vocabulary"),
    # rows that already pack documents: FlexSP would attend across them (Hugging Face keeps them apart)
    ({"position_ids": [0, 1, 2, 0, 1, 2]}, "column 'position_ids' is 0 at position 3, not 0..5: a row packing "
                                           "several documents"),
    ({"seq_lengths": [2, 4]}, "column 'seq_lengths' lists 2 documents packed in one row"),
])
def test_bad_columns_are_one_line_errors_naming_row_and_column(columns, message):
    with pytest.raises(LabelsError, match=message) as info:
        _read(columns)
    assert "\n" not in str(info.value)


def test_label_ids_are_labels_as_huggingfaces_collators_read_them():
    """``label_ids`` was not read at all: every token of the row was trained, where the plain Trainer (whose
    collators rename it) trains the labelled ones; beside ``labels`` it is ignored, as the collators do."""
    t, n = _read({"label_ids": [I, 40, 41, I, I, 3]})
    assert t.tolist() == [I, 40, 41, I, I, 3] and n == 3
    t, n = _read({"labels": [I, I, I, 4, 5, 6], "label_ids": [I, 40, 41, I, I, 3]})
    assert t.tolist() == [I, I, I, 4, 5, 6] and n == 3
    t, n = _read({"label_ids": [1, 2, I, 4, 5, 6], "completion_mask": [0, 1, 0, 1, 1, 1]})
    assert n == 4


def test_columns_that_change_nothing_are_read_as_before():
    """A classification ``label`` (one number), an all-ones ``attention_mask``, boolean masks, positions 0..n-1 and
    one document's ``seq_lengths`` are fine."""
    assert _read({"position_ids": list(range(6)), "seq_lengths": [6]}) == (None, 5)
    assert _read({"position_ids": np.arange(6, dtype=np.float32)}) == (None, 5)   # as pandas may store them
    assert _read({"label": 3}) == (None, 5)
    assert _read({"attention_mask": [1] * 6, "label": [1, 2]}) == (None, 5)
    t, n = _read({"completion_mask": [False, False, True, True, True, True]})
    assert t.tolist() == [I, I, 3, 4, 5, 6] and n == 4


def test_a_host_mask_beside_device_tokens_gives_targets_where_the_tokens_are():
    """``run_plan`` rows may hold their ``input_ids`` on the GPU and a mask or labels on the host (or the reverse):
    the checks and the count run on host copies, the targets are built on the tokens' device ("meta" stands in
    for CUDA here: a 1-D host tensor cannot meet a CUDA one in ``torch.where``)."""
    mask = [0, 0, 0, 1, 1, 1, 1, 1]
    targets, supervised = read_targets({"completion_mask": mask}, torch.arange(8, device="meta"), "batch[0]")
    assert targets.device.type == "meta" and supervised == 5
    targets, supervised = read_targets({"labels": [-100, -100, 7, 8]}, torch.arange(4, device="meta"), "batch[1]")
    assert targets.device.type == "meta" and supervised == 2


def test_loader_refuses_token_ids_outside_the_vocabulary_and_bad_settings():
    """Ids past the vocabulary used to reach the embedding inside the step (after its collectives started:
    an IndexError on CPU, a device assert on CUDA); negative ones whatever the vocabulary."""
    import flexsp
    from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError
    cost = flexsp.CostModel(alpha1=1e-6, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1e3,
                            alltoall_bandwidth={2: 1e9}, token_capacity=64, meta={"sharding": "none"})
    cluster, config = flexsp.Cluster(num_gpus=2, gpus_per_node=2), LoaderConfig(batch_size=4, lookahead=0, prefetch=False)
    for vocab, bad, message in ((32, 32, "dataset item 1: token 2 is 32, outside the vocabulary 0..31"),
                                (None, -3, "dataset item 1: token 2 is -3, outside the ids >= 0")):
        rows = [[1, 2, 3], [4, 5, bad, 6], [7, 8], [9, 10, 11]]
        with FlexSPLoader(rows, cost, cluster, vocab_size=vocab, config=config) as loader:
            with pytest.raises(LoaderError, match=message):
                next(iter(loader))
    for value in (0, 2.7, True, "abc"):
        with pytest.raises(LoaderError, match="vocab_size must be"):
            FlexSPLoader([[1, 2]], cost, cluster, vocab_size=value, config=config)
    for seed in (-1, 1.5, None):
        with pytest.raises(LoaderError, match="seed must be"):
            LoaderConfig(batch_size=4, seed=seed)
    assert LoaderConfig(batch_size=4, seed=np.int64(3)).seed == 3 and type(LoaderConfig(batch_size=4, seed=np.int64(3)).seed) is int


def test_a_dataset_that_fails_to_read_an_item_is_named():
    import flexsp
    from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError

    class Flaky(list):
        def __getitem__(self, i):
            if i == 2:
                raise OSError("disk read failed")
            return super().__getitem__(i)
    cost = flexsp.CostModel(alpha1=1e-6, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1e3,
                            alltoall_bandwidth={2: 1e9}, token_capacity=64, meta={"sharding": "none"})
    with FlexSPLoader(Flaky([[1, 2, 3], [4, 5], [6, 7], [8]]), cost, flexsp.Cluster(num_gpus=2, gpus_per_node=2),
                      config=LoaderConfig(batch_size=4, lookahead=0, prefetch=False)) as loader:
        with pytest.raises(LoaderError, match="dataset item 2 could not be read: OSError: disk read failed"):
            next(iter(loader))


def test_run_plan_refuses_ids_the_cast_or_the_embedding_would_change():
    """``run_plan`` truncated float ids (1.9 trained as 1) and read booleans as 0 and 1."""
    from flexsp.errors import PlanError
    from flexsp.runtime.step import _rows
    for rows, message in (([torch.tensor([1.9, 2.7])], "batch\\[0\\] \\(token ids\\): must be a 1-D sequence of integers"),
                          ([torch.tensor([1, 2]), torch.tensor([True, False])], "batch\\[1\\] \\(token ids\\)"),
                          ([torch.tensor([1, 50])], "batch\\[0\\]: token 1 is 50, outside the vocabulary 0..49"),
                          ([torch.tensor([-1, 2])], "batch\\[0\\]: token 0 is -1")):
        with pytest.raises(PlanError, match=message):
            _rows(rows, 50)
    tokens, targets, supervised = _rows([torch.tensor([1, 2, 3], dtype=torch.int32)], 50)
    assert targets is None and supervised == 2


def test_loader_names_the_bad_row_before_training():
    import flexsp
    from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError
    rows = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (5, 7, 4, 6)]
    rows[2]["labels"] = rows[2]["labels"][:-1]
    cost = flexsp.CostModel(alpha1=1e-6, alpha2=1e-4, beta1=1e-3, comm_bytes_per_token=1e3,
                            alltoall_bandwidth={2: 1e9}, token_capacity=64, meta={"sharding": "none"})
    loader = FlexSPLoader(rows, cost, flexsp.Cluster(num_gpus=2, gpus_per_node=2), vocab_size=32,
                          config=LoaderConfig(batch_size=4, lookahead=0, prefetch=False))
    with pytest.raises((LoaderError, LabelsError), match="dataset item 2, column 'labels': 3 entries but input_ids has 4"):
        next(iter(loader))
    loader.close()
