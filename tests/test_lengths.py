"""Length distributions: validation, loading, bundled data, approximations, sampling, preprocessing."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsp.errors import LengthsError
from flexsp.plan.lengths import LengthDistribution, as_lengths, get_distribution, load_lengths, preprocess

# ------------------------------------------------------------------------------------- as_lengths


@pytest.mark.parametrize("values", [[3, 1, 2], (3, 1, 2), np.array([3, 1, 2], dtype=np.int32),
                                    np.array([3, 1, 2], dtype=np.uint16), [3.0, 1.0, 2.0],
                                    np.array([3.0, 1.0, 2.0]), iter([3, 1, 2])])
def test_as_lengths_accepts_integral_values(values):
    out = as_lengths(values)
    assert out.dtype == np.int64
    assert out.tolist() == [3, 1, 2]


def test_as_lengths_returns_a_copy():
    src = np.array([5, 6], dtype=np.int64)
    out = as_lengths(src)
    out[0] = 99
    assert src[0] == 5


@pytest.mark.parametrize("values, match", [
    ([4, 0, 2], r"lengths\[1\] = 0 .*>= 1"),
    ([4, 2, -3], r"lengths\[2\] = -3 .*>= 1"),
    ([1, 1.5], r"lengths\[1\] = 1.5 .*whole number"),
    ([1, float("nan")], r"lengths\[1\] = nan .*finite"),
    (np.array([1.0, np.inf]), r"lengths\[1\] = inf .*finite"),
    ([True, 2], r"lengths\[0\] = True .*bool"),
    ([1, np.bool_(False)], r"lengths\[1\] = False .*bool"),
    (np.array([True, True]), r"lengths\[0\] = True .*bool"),
    ([1, "2"], r"lengths\[1\] = '2' .*str"),
    (np.array(["1", "2"]), r"lengths\[0\] = '1' .*dtype"),
    ([1, None], r"lengths\[1\] = None"),
    ([7, 2 ** 70], r"lengths\[1\] = \d+ .*too large"),
    ([[1, 2]], r"lengths\[0\] = \[1, 2\]"),
])
def test_as_lengths_names_first_bad_value_and_index(values, match):
    with pytest.raises(LengthsError, match=match):
        as_lengths(values)


@pytest.mark.parametrize("values, match", [
    ([], "empty"), (np.array([], dtype=np.int64), "empty"), ("123", "got str"), (5, "got int"),
    ({1: 2}, "got dict"), (np.ones((2, 2), dtype=int), "one-dimensional"),
])
def test_as_lengths_rejects_wrong_shapes_and_types(values, match):
    with pytest.raises(LengthsError, match=match):
        as_lengths(values)


def test_as_lengths_reports_the_first_of_several_bad_values():
    values = np.full(131_072, 100, dtype=np.int64)
    values[[70_000, 90_000]] = [0, -1]
    with pytest.raises(LengthsError, match=r"lengths\[70000\] = 0"):
        as_lengths(values)


@given(st.lists(st.integers(1, 2 ** 62), min_size=1, max_size=200))
def test_as_lengths_round_trips_positive_ints(values):
    assert as_lengths(values).tolist() == values


# ------------------------------------------------------------------------------------------ loading


def test_load_txt_ignores_blank_lines(tmp_path: Path):
    path = tmp_path / "l.txt"
    path.write_text("5\n\n 7 \n3\n\n")
    assert load_lengths(path).tolist() == [5, 7, 3]


def test_load_txt_gz(tmp_path: Path):
    path = tmp_path / "l.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("10\n20\n30\n")
    assert load_lengths(path).tolist() == [10, 20, 30]


def test_load_npy(tmp_path: Path):
    path = tmp_path / "l.npy"
    np.save(path, np.array([4, 8, 15], dtype=np.int32))
    out = load_lengths(path)
    assert out.dtype == np.int64 and out.tolist() == [4, 8, 15]


@pytest.mark.parametrize("text, match", [
    ("5\n\nabc\n", r"l\.txt, line 3: 'abc' is not an integer"),
    ("5\n1.5\n", r"line 2: '1.5' is not an integer"),
    ("5\n6\n0\n", r"line 3: 0 is not a valid sequence length"),
    ("5\n\n-4\n", r"line 3: -4 "),
    ("1 2\n", r"line 1: '1 2'"),
    ("\n\n", r"holds no lengths"),
    ("", r"holds no lengths"),
])
def test_load_txt_errors_name_file_and_line(tmp_path: Path, text, match):
    path = tmp_path / "l.txt"
    path.write_text(text)
    with pytest.raises(LengthsError, match=match):
        load_lengths(path)


def test_load_errors_for_missing_corrupt_and_bad_npy(tmp_path: Path):
    with pytest.raises(LengthsError, match="no such lengths file"):
        load_lengths(tmp_path / "missing.txt")
    bad_gz = tmp_path / "bad.txt.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(LengthsError, match="bad.txt.gz: cannot read"):
        load_lengths(bad_gz)
    bad_npy = tmp_path / "bad.npy"
    bad_npy.write_bytes(b"garbage")
    with pytest.raises(LengthsError, match="bad.npy: not a readable"):
        load_lengths(bad_npy)
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([3, -1]))
    with pytest.raises(LengthsError, match=r"neg.npy: lengths\[1\] = -1"):
        load_lengths(neg)


# ------------------------------------------------------------------------------------ distributions


def test_bundled_wikipedia_matches_design_md():
    dist = get_distribution("wikipedia")
    x = dist.lengths
    assert len(dist) == 1_000_000
    assert np.median(x) == 347
    assert abs(x.mean() - 1014) < 1
    assert x.max() == 1_823_777
    assert round(float(np.mean(x <= 8192)), 3) == 0.984
    assert not dist.approximate and "Apache-2.0" in dist.source
    assert dist.describe() == ("wikipedia: 1,000,000 lengths, median 347, mean 1,014, "
                               "max 1,823,777, 98.4% <= 8192")


def test_bundled_data_ships_with_attribution():
    data = Path(__import__("flexsp").__file__).parent / "lengths_data"
    text = (data / "ATTRIBUTION.md").read_text()
    assert "Apache" in text and "approximation" in text.lower()


@pytest.mark.parametrize("name", ["github", "commoncrawl"])
def test_approximations_are_deterministic_and_labelled(name):
    a, b = get_distribution(name, seed=0), get_distribution(name.upper(), seed=0)
    assert a.approximate and "approximation" in a.source and "not the real corpus" in a.source
    assert a.describe().endswith("[APPROXIMATION]")
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert not np.array_equal(a.lengths, get_distribution(name, seed=1).lengths)


def test_approximation_shapes_follow_the_paper():
    """GitHub: heavier long tail than Wikipedia; CommonCrawl: mostly short, thinner tail."""
    wiki, gh, cc = (get_distribution(n).lengths for n in ("wikipedia", "github", "commoncrawl"))
    for threshold in (32_768, 131_072):
        assert np.mean(gh > threshold) > 5 * np.mean(wiki > threshold)
        assert np.mean(cc > threshold) < np.mean(wiki > threshold)
    assert np.mean(cc <= 8192) > 0.99
    assert gh.max() > 256_000 and cc.max() > 32_768  # both still long-tailed


def test_distribution_lengths_are_read_only():
    dist = get_distribution("wikipedia")
    with pytest.raises(ValueError):
        dist.lengths[0] = 1


def test_get_distribution_from_file(tmp_path: Path):
    path = tmp_path / "mine.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("1\n2\n3\n")
    dist = get_distribution(path)
    assert dist.name == "mine" and len(dist) == 3 and not dist.approximate
    assert get_distribution(str(path)).lengths.tolist() == [1, 2, 3]


def test_get_distribution_unknown_name_lists_choices():
    with pytest.raises(LengthsError, match="wikipedia, github, commoncrawl"):
        get_distribution("wiki")
    with pytest.raises(LengthsError, match="no such lengths file"):
        get_distribution("nowhere/lengths.txt")
    with pytest.raises(LengthsError, match="non-negative integer"):
        get_distribution("github", seed=-1)


def test_length_distribution_validates_its_lengths():
    with pytest.raises(LengthsError, match=r"toy lengths\[1\] = 0"):
        LengthDistribution("toy", np.array([1, 0]), False, "test")


def test_sampling_is_reproducible_per_seed():
    dist = get_distribution("wikipedia")
    a, b, c = dist.sample_batch(512, 7), dist.sample_batch(512, 7), dist.sample_batch(512, 8)
    assert a.shape == (512,) and a.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.isin(a, dist.lengths).all()
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    np.testing.assert_array_equal(dist.sample_batch(64, g1), dist.sample_batch(64, g2))
    assert not np.array_equal(dist.sample_batch(64, g1), dist.sample_batch(64, np.random.default_rng(3)))


def test_sampling_is_with_replacement():
    dist = LengthDistribution("toy", [5, 9], False, "test")
    batch = dist.sample_batch(1000, 0)
    assert set(batch.tolist()) == {5, 9}


@pytest.mark.parametrize("batch_size, seed, match", [
    (0, 0, "batch_size"), (2.5, 0, "batch_size"), (True, 0, "batch_size"),
    (4, -1, "rng_or_seed"), (4, "a", "rng_or_seed"), (4, 1.0, "rng_or_seed"),
])
def test_sampling_rejects_bad_arguments(batch_size, seed, match):
    dist = LengthDistribution("toy", [5, 9], False, "test")
    with pytest.raises(LengthsError, match=match):
        dist.sample_batch(batch_size, seed)


# ------------------------------------------------------------------------------------ preprocessing


def test_preprocess_drops_and_rounds():
    kept, dropped = preprocess([1, 15, 16, 17, 96, 97, 500], context_limit=96, num_gpus=8)
    assert kept.tolist() == [16, 16, 16, 32, 96]
    assert dropped == 2


def test_preprocess_keeps_padded_lengths_within_a_limit_that_is_not_a_multiple():
    # 2 x 8 = 16; the longest padded length that fits 100 is 96, so 97..100 are dropped too.
    kept, dropped = preprocess([96, 97, 100], context_limit=100, num_gpus=8)
    assert kept.tolist() == [96] and dropped == 2


def test_preprocess_without_rounding_only_drops():
    kept, dropped = preprocess([3, 100, 101], context_limit=100, num_gpus=8, round_to_multiple=False)
    assert kept.tolist() == [3, 100] and dropped == 1


def test_preprocess_rejects_bad_arguments():
    with pytest.raises(LengthsError, match="context_limit"):
        preprocess([1], context_limit=0, num_gpus=1)
    with pytest.raises(LengthsError, match="num_gpus"):
        preprocess([1], context_limit=10, num_gpus=0)
    with pytest.raises(LengthsError, match="below 2 x num_gpus"):
        preprocess([1], context_limit=10, num_gpus=8)
    with pytest.raises(LengthsError, match=r"lengths\[0\] = 0"):
        preprocess([0], context_limit=10, num_gpus=1)


@settings(max_examples=200)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=100), st.integers(1, 4096),
       st.sampled_from([1, 2, 4, 8, 64]))
def test_preprocess_properties(lengths, context_limit, num_gpus):
    multiple = 2 * num_gpus
    if context_limit < multiple:
        with pytest.raises(LengthsError):
            preprocess(lengths, context_limit, num_gpus)
        return
    kept, dropped = preprocess(lengths, context_limit, num_gpus)
    assert kept.size + dropped == len(lengths)
    assert (kept % multiple == 0).all() and (kept <= context_limit).all()
    # Order and identity preserved: each kept value is the first multiple >= its original.
    originals = [x for x in lengths if -(-x // multiple) * multiple <= context_limit]
    assert kept.tolist() == [-(-x // multiple) * multiple for x in originals]


def test_a_byte_order_mark_is_not_data_and_overlong_numbers_are_named(tmp_path):
    from flexsp.errors import LengthsError
    from flexsp.plan.lengths import load_lengths
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf12\r\n13\r\n")
    assert load_lengths(path).tolist() == [12, 13]
    path.write_bytes(b"9" * 5000 + b"\n")
    with pytest.raises(LengthsError, match="line 1: a 5000-digit number is not a valid sequence length"):
        load_lengths(path)


# ------------------------------------------------------------------------------------- context bound


def test_bound_context_refuses_a_longer_sequence_by_default():
    from flexsp.errors import ContextError
    from flexsp.plan.lengths import bound_context
    with pytest.raises(ContextError, match="sequence 1 with 4,000"):
        bound_context([1000, 4000, 800], 1024)
    same, cut = bound_context([1000, 1024, 800], 1024)
    assert same.tolist() == [1000, 1024, 800] and cut == 0


def test_bound_context_truncates_on_request():
    from flexsp.plan.lengths import bound_context
    out, cut = bound_context([1000, 4000, 800, 2000], 1024, "truncate")
    assert out.tolist() == [1000, 1024, 800, 1024] and cut == 2
    with pytest.raises(LengthsError, match="policy"):
        bound_context([1], 10, "drop")


def test_plan_cli_refuses_or_cuts_over_context(tmp_path, capsys):
    from flexsp.cli import main
    path = tmp_path / "lengths.txt"
    path.write_text("1000\n4000\n800\n")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--context", "1K", "--gpus", "8", "-o", str(out)]) == 2
    assert "context limit" in capsys.readouterr().err and not out.exists()
    assert main(["plan", str(path), "--context", "1K", "--gpus", "8", "-o", str(out),
                 "--over-context", "truncate"]) == 0
    from flexsp.plan.types import Plan
    assert "cut 1 sequence" in capsys.readouterr().out
    assert sorted(i for mb in Plan.from_json(out.read_text()).micro_batches for g in mb.groups for i in g.seq_ids) == [0, 1, 2]
