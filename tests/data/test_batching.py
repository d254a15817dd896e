"""Global batches: every sequence once per epoch, seeded shuffles, token budgets, too-long policy, lengths."""
import numpy as np
import pytest
from helpers import lengths as make_lengths

from flexsp.data import EpochBatches, LoaderConfig, LoaderError, resolve_lengths


def _flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("config", [LoaderConfig(batch_size=7), LoaderConfig(max_tokens=500),
                                    LoaderConfig(batch_size=64, shuffle=False)])
def test_every_sequence_exactly_once_per_epoch(config):
    lengths = np.array(make_lengths(100))
    eb = EpochBatches(lengths, config, capacity=256)
    for epoch in range(3):
        assert sorted(_flat(eb.epoch(epoch))) == list(range(100))
    if config.shuffle:
        assert eb.epoch(0) != eb.epoch(1)   # reshuffled per epoch
        assert EpochBatches(lengths, config, 256).epoch(1) == eb.epoch(1)   # deterministic from the seed


def test_drop_last_leaves_out_the_partial_batch_only():
    lengths = np.array(make_lengths(20))
    kept = EpochBatches(lengths, LoaderConfig(batch_size=6), capacity=256).epoch(0)
    dropped = EpochBatches(lengths, LoaderConfig(batch_size=6, drop_last=True), capacity=256).epoch(0)
    assert [len(b) for b in kept] == [6, 6, 6, 2] and dropped == kept[:3]
    full = EpochBatches(lengths, LoaderConfig(batch_size=5, drop_last=True), capacity=256).epoch(0)
    assert sorted(_flat(full)) == list(range(20))   # nothing partial: nothing dropped
    with pytest.raises(LoaderError, match="drop_last=True leaves no batch: the 20 sequences of an epoch are fewer than one batch of 32"):
        EpochBatches(lengths, LoaderConfig(batch_size=32, drop_last=True), capacity=256).epoch(0)


def test_token_budget_respected_and_oversized_sequence_alone():
    lengths = np.array([100, 30, 400, 80, 80, 50, 10])
    batches = EpochBatches(lengths, LoaderConfig(max_tokens=200, shuffle=False), capacity=1000).epoch(0)
    assert batches == [(0, 1), (2,), (3, 4), (5, 6)]
    assert all(lengths[list(b)].sum() <= 200 or len(b) == 1 for b in batches)


def test_iterate_resumes_and_crosses_epochs():
    eb = EpochBatches(np.array(make_lengths(20)), LoaderConfig(batch_size=6), capacity=256)
    it = eb.iterate(0, 2)
    got = [next(it) for _ in range(4)]
    assert [b.key for b in got] == [(0, 2), (0, 3), (1, 0), (1, 1)]
    assert got[1].last and not got[0].last
    assert got[0].indices == eb.epoch(0)[2]
    with pytest.raises(LoaderError, match="cannot resume at batch 9 of epoch 0: it has 4 batches"):
        next(eb.iterate(0, 9))


def test_too_long_error_names_index_and_length():
    lengths = np.array([10, 20, 300, 5, 999])
    eb = EpochBatches(lengths, LoaderConfig(batch_size=2), capacity=256)
    with pytest.raises(LoaderError, match=r"sequence 2 has 300 tokens .* holds 256 \(2 sequence\(s\) are too long\)"):
        eb.epoch(0)


def test_too_long_skip_is_counted_never_silent():
    lengths = np.array([10, 20, 300, 5, 999])
    eb = EpochBatches(lengths, LoaderConfig(batch_size=2, on_too_long="skip"), capacity=256)
    assert sorted(_flat(eb.epoch(0))) == [0, 1, 3]
    assert next(eb.iterate(0, 0)).skipped == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "set exactly one of batch_size"), (dict(batch_size=4, max_tokens=9), "set exactly one"),
    (dict(batch_size=0), "batch_size must be a positive integer, got 0"),
    (dict(batch_size=4, on_too_long="truncate"), "on_too_long='truncate'; choose one of error, skip"),
    (dict(batch_size=4, lookahead=-1), "lookahead must be an integer >= 0"),
    (dict(max_tokens=9, drop_last=True), "drop_last=True needs batch_size"),
    (dict(batch_size=4, drop_last=1), "drop_last must be True or False, got 1"),
])
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(LoaderError, match=message):
        LoaderConfig(**kwargs)


class Rows:
    """A map-style dataset of dicts, with an optional column listing like Hugging Face's."""

    def __init__(self, rows, column_names=None):
        self.rows, self.column_names = rows, column_names

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        if isinstance(key, str):
            return [r[key] for r in self.rows]
        return self.rows[key]


def test_lengths_from_argument_column_or_items():
    items = [[1, 2, 3], [4], [5, 6]]
    assert resolve_lengths(items).tolist() == [3, 1, 2]
    assert resolve_lengths(items, lengths=[3, 1, 2]).tolist() == [3, 1, 2]
    rows = Rows([{"input_ids": x, "length": len(x)} for x in items], column_names=["input_ids", "length"])
    assert resolve_lengths(rows).tolist() == [3, 1, 2]
    assert resolve_lengths(Rows([{"input_ids": x} for x in items])).tolist() == [3, 1, 2]


def test_lengths_errors_name_the_item():
    with pytest.raises(LoaderError, match=r"len\(\) of each item: lengths\[1\] = 0 .* >= 1"):
        resolve_lengths([[1], [], [2]])
    with pytest.raises(LoaderError, match="has 2 entries but the dataset has 3 items"):
        resolve_lengths([[1], [2], [3]], lengths=[1, 1])
    with pytest.raises(LoaderError, match="dataset item 0 is a mapping without 'input_ids'"):
        resolve_lengths([{"text": "hi"}])
    with pytest.raises(LoaderError, match="dataset is empty"):
        resolve_lengths([])
