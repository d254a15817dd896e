"""A restored loader state is checked, not trusted (issue 31, point 5): before, ``index=-5`` was
accepted and the run trained the same batches twice."""
import pytest
from helpers import cluster, cost_model, token_lists

from flexsp import PlanConfig
from flexsp.data import FlexSPLoader, LoaderConfig, LoaderError

CONFIG = LoaderConfig(batch_size=8, seed=2, plan=PlanConfig(strategy="greedy"))


def _state(data, config=CONFIG, **changes):
    with FlexSPLoader(data, cost_model(), cluster(), config) as loader:
        next(iter(loader))
        state = loader.state_dict()
    return {**state, **changes}


@pytest.mark.parametrize("changes, message", [
    ({"index": -5}, "'index' must be an integer >= 0, got -5"),
    ({"epoch": -1}, "'epoch' must be an integer >= 0"),
    ({"step": 1.5}, "'step' must be an integer >= 0"),
    ({"index": True}, "'index' must be an integer"),
    ({"index": 99}, "index 99 is past epoch 0's 4 batches"),
    ({"index": 4}, "index 4 is past epoch 0's 4 batches"),   # one past the last: no batch to train from
    ({"batching": "x"}, "'batching' must be a dict"),
    ({"world_size": 8}, "world of 8 ranks, this loader plans for 4"),
    ({"world_size": "4"}, "'world_size' must be an integer >= 1, got '4'"),
    ({"version": 99}, "loader state version 99 is not the supported 1"),
    ({"version": "x"}, "loader state version 'x' is not the supported 1"),
])
def test_bad_positions_and_worlds_are_named(changes, message):
    data = token_lists(30)
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG) as loader:
        with pytest.raises(LoaderError, match=message):
            loader.load_state_dict(_state(data, **changes))


def test_another_dataset_of_the_same_size_is_refused():
    state = _state(token_lists(30, seed=0))
    with FlexSPLoader(token_lists(30, seed=1), cost_model(), cluster(), CONFIG) as loader:
        with pytest.raises(LoaderError, match="another dataset"):
            loader.load_state_dict(state)


def test_another_seed_is_refused_and_a_good_state_resumes():
    data = token_lists(30)
    state = _state(data)
    other = LoaderConfig(batch_size=8, seed=3, plan=PlanConfig(strategy="greedy"))
    with FlexSPLoader(data, cost_model(), cluster(), other) as loader:
        with pytest.raises(LoaderError, match=r"'seed': \(2, 3\)"):
            loader.load_state_dict(state)
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG) as loader:
        loader.load_state_dict(state)
        assert next(iter(loader)).index == 1
        loader.load_state_dict({**state, "world_size": 8}, world_size_change=True)


def test_a_resume_on_another_capacity_that_leaves_out_other_sequences_is_refused():
    """on_too_long="skip": which sequences an epoch leaves out follows the largest group's capacity, and the
    epoch's batches follow that set; a state resumed on another capacity (same world) would lose or repeat
    sequences, so it is refused, through the loader's own load_state_dict, not only the Checkpointer's."""
    data = token_lists(30)
    longest = max(len(row) for row in data)
    skip = LoaderConfig(batch_size=8, seed=2, on_too_long="skip", plan=PlanConfig(strategy="greedy"))
    # capacity per GPU: the saved run holds every sequence on 4 GPUs, the resumed one not the longest
    roomy, tight = cost_model(token_capacity=longest), cost_model(token_capacity=(longest - 1) // 4)
    with FlexSPLoader(data, roomy, cluster(), skip) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert state["left_out"][0] == 0
    with FlexSPLoader(data, tight, cluster(), skip) as loader:
        with pytest.raises(LoaderError, match=r"left out 0 too-long sequence\(s\).*a different set \([1-9]\d* left out\)"):
            loader.load_state_dict(state)
    with FlexSPLoader(data, cost_model(token_capacity=longest * 2), cluster(), skip) as loader:
        loader.load_state_dict(state)          # more room, the same (empty) set: resumes
        assert next(iter(loader)).index == 1
    with FlexSPLoader(data, roomy, cluster(), skip) as loader:
        with pytest.raises(LoaderError, match=r"'left_out' must be \[count, crc32\]"):
            loader.load_state_dict({**state, "left_out": "x"})


def test_drop_last_is_part_of_the_batching_a_resume_must_match():
    """A state saved before ``drop_last`` existed kept every batch: it resumes a loader without drop_last, and a
    loader with it is refused (its epochs have one batch fewer)."""
    data = token_lists(30)
    old = _state(data)
    old["batching"].pop("drop_last")
    with FlexSPLoader(data, cost_model(), cluster(), CONFIG) as loader:
        loader.load_state_dict(old)
    dropping = LoaderConfig(batch_size=8, seed=2, plan=PlanConfig(strategy="greedy"), drop_last=True)
    with FlexSPLoader(data, cost_model(), cluster(), dropping) as loader:
        with pytest.raises(LoaderError, match=r"'drop_last': \(False, True\)"):
            loader.load_state_dict(old)
