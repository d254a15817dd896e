import numpy as np
import pytest

from solver.group_packing import MicroBatchPacker
from solver.types import DegreeCosts

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)


def check(packer: MicroBatchPacker, counts: np.ndarray, packing) -> None:
    packing = packing.expanded()
    assert (packing.counts.sum(axis=0) == counts).all(), "every sequence packed once"
    degrees = np.asarray(COSTS.degrees)[packing.degree_idx]
    assert degrees.sum() <= packer.num_gpus
    tokens = packing.counts @ packer.lengths
    assert (tokens <= np.asarray(COSTS.capacity)[packing.degree_idx] + 1e-9).all()
    times = packer.group_times(packing) + COSTS.beta1
    assert times.max() == pytest.approx(packing.makespan)


@pytest.mark.parametrize("seed", range(20))
def test_bisection_packs_within_bounds(seed):
    rng = np.random.default_rng(seed)
    lengths = np.unique(rng.integers(1, 800, size=rng.integers(1, 8)))
    counts = rng.integers(0, 6, size=len(lengths))
    counts[-1] = max(counts[-1], 1)
    packer = MicroBatchPacker(lengths, COSTS, num_gpus=8)
    packing = packer.solve(counts)
    if packing is None:  # memory: must really be impossible on 8 GPUs
        assert (counts * lengths).sum() > 0.75 * 800 or lengths[counts > 0].max() > 800
        return
    check(packer, counts, packing)
    assert packing.makespan >= packer.lower_bound(counts) - 1e-12


def test_pack_refuses_more_gpus_than_the_cluster():
    packer = MicroBatchPacker(np.array([100.0]), COSTS, num_gpus=2)
    assert packer.pack(np.array([3]), np.inf) is None           # three full GPUs of memory
    assert packer.pack(np.array([2]), np.inf) is not None


def test_group_classes_scale_with_gpus_not_sequences():
    """52,000 short sequences on 4096 GPUs pack in one call without per-sequence work."""
    costs = DegreeCosts(degrees=(1, 2), quad=(1e-9, 5e-10), lin=(1e-4, 6e-5), capacity=(8192.0, 16384.0), beta1=0.5)
    packer = MicroBatchPacker(np.array([300.0, 1000.0, 5000.0]), costs, num_gpus=4096)
    counts = np.array([40_000, 10_000, 2_000])
    packing = packer.solve(counts)
    assert packing is not None and (packing.total_counts() == counts).all()


@pytest.mark.parametrize("seed", range(5))
def test_distinct_rows_matches_numpy_unique(seed):
    """``evaluate``'s row dedup: the same distinct rows and mapping as ``np.unique(axis=0)``, in order
    of first appearance."""
    from solver.search import distinct_rows
    rng = np.random.default_rng(seed)
    matrix = rng.integers(0, 3, size=(int(rng.integers(1, 30)), 4))
    rows, inverse = distinct_rows(matrix)
    assert (rows[inverse] == matrix).all()
    expected = np.unique(matrix, axis=0)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected.tolist()))
    assert list(inverse[np.sort(np.unique(inverse, return_index=True)[1])]) == list(range(len(rows)))


def test_solve_returns_the_last_packing_the_bisection_found():
    """``solve`` expands only the bisection's last success: its makespan is the smallest one found and
    the packing holds every sequence."""
    lengths = np.array([300.0, 120.0, 40.0, 10.0])
    counts = np.array([1, 1, 3, 6])
    packer = MicroBatchPacker(lengths, COSTS, num_gpus=8)
    packing = packer.solve(counts)
    check(packer, counts, packing)
    assert packing.makespan < packer.pack_memory(counts).makespan
    again = packer.pack(counts, packing.makespan * (1 + 1e-12))
    assert again is not None and again.makespan == pytest.approx(packing.makespan)


@pytest.mark.parametrize("seed", range(20))
def test_solve_below_a_known_makespan_finds_one_under_it_or_says_none(seed):
    """``solve(counts, below=X)``: a valid packing no slower than X, or None when the packer finds none under
    X; that None is not cached, so a later plain ``solve`` of the same counts still packs them."""
    rng = np.random.default_rng(seed)
    lengths = np.unique(rng.integers(1, 800, size=rng.integers(2, 8)))
    counts = rng.integers(1, 6, size=len(lengths))
    plain = MicroBatchPacker(lengths, COSTS, num_gpus=8).solve(counts)
    if plain is None:
        return
    above = MicroBatchPacker(lengths, COSTS, num_gpus=8)
    got = above.solve(counts, below=plain.makespan * 1.5)
    check(above, counts, got)
    assert got.makespan <= plain.makespan * 1.5
    assert got.makespan <= plain.makespan * (1 + 2e-3) + 1e-12     # as good as the plain bisection, to its tolerance
    under = MicroBatchPacker(lengths, COSTS, num_gpus=8)
    assert under.solve(counts, below=under.lower_bound(counts) * 0.5) is None
    again = under.solve(counts)
    check(under, counts, again)
    assert again.makespan == plain.makespan
