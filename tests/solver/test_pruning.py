"""The search skips work on lower bounds and reuses refined micro-batches; that is safe only if each
bound is never above what the skipped work would have found, and a reused result is what a fresh
refine gives. Checked here on random batches (the plans' sameness is what the bounds buy)."""
import numpy as np
import pytest

from solver.search import BatchSearch, SearchOptions
from solver.types import DegreeCosts

COSTS = DegreeCosts(degrees=(1, 2, 4, 8), quad=(1e-6, 5e-7, 2.5e-7, 1.25e-7),
                    lin=(1e-3, 6e-4, 3.5e-4, 2e-4), capacity=(100.0, 200.0, 400.0, 800.0), beta1=0.05)


def splits(search: BatchSearch) -> list:
    first = search.first_split()
    searched = search.best_split(first)
    return [first, searched, search.improve(searched), search.evict(searched), search.merge(searched)]


@pytest.mark.parametrize("seed", range(12))
def test_real_bound_never_exceeds_the_refined_time(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(9, 80)))
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    for split in splits(search):
        refined = search.refine_members(search.members(split))
        assert search.real_bound(split) <= refined.time
        assert sum(search.bound(row) for row in search.counts(split.assignment, len(split.packings))) <= split.makespan


@pytest.mark.parametrize("seed", range(6))
def test_a_reused_refinement_is_a_fresh_one(seed, monkeypatch):
    import solver.search
    calls = []
    tighten = solver.search.tighten_members
    monkeypatch.setattr(solver.search, "tighten_members", lambda *a, **k: calls.append(1) or tighten(*a, **k))
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(9, 80)))
    warm = BatchSearch(lengths, COSTS, 8, SearchOptions())
    for split in splits(warm):
        warm.refine_members(warm.members(split))
        calls.clear()
        again = warm.refine_members(warm.members(split))           # every micro-batch from the cache now
        assert not calls
        fresh = BatchSearch(lengths, COSTS, 8, SearchOptions()).refine_members(warm.members(split))
        assert again.time == fresh.time
        for (a_members, a_deg), (f_members, f_deg) in zip(again.micro_batches, fresh.micro_batches):
            assert np.array_equal(a_deg, f_deg)
            assert all(np.array_equal(a, f) for a, f in zip(a_members, f_members))


@pytest.mark.parametrize("seed", range(8))
def test_bounds_on_arrays_are_bound_bit_for_bit(seed):
    """``bounds`` (numpy, from 16 rows) prunes exactly what ``bound`` (a plain loop) would: the same
    floats, for rows with missing buckets, an empty row and rows of one bucket."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(20, 200)))
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    rows = rng.integers(0, 6, size=(40, search.num_buckets)) * (rng.random((40, search.num_buckets)) < 0.5)
    rows[0] = 0
    rows[1] = 0
    rows[1, -1] = 3
    got = search.bounds(rows)
    assert got.tolist() == [search.bound(row) for row in rows]
    assert got[0] == 0.0 and search.bound_sum(rows) == float(np.array([search.bound(r) for r in rows]).sum())


def test_the_sweep_packs_fewer_points_on_small_batches(monkeypatch):
    """``sweep_points``: 24 makespans (and 8 below the slowest sequence) on big batches or long degree
    ladders, fewer on small problems, never fewer than 12; counted on the whole-batch packings
    ``arranged_candidates`` asks for."""
    from solver import search
    assert [search.sweep_points(n, 4) for n in (9, 48, 64, 95, 96, 10_000)] == [12, 12, 16, 23, 24, 24]
    assert [search.sweep_points(16, d) for d in (3, 5, 7, 13)] == [12, 15, 21, 24]   # 4 .. 4,096 GPUs
    for n, points in ((16, 12), (200, 24)):
        lengths = np.random.default_rng(n).integers(10, 90, size=n)
        sweep = BatchSearch(lengths, COSTS, 8, SearchOptions())
        asked = []
        monkeypatch.setattr(sweep, "arranged_split", lambda makespan, **kw: asked.append(makespan))
        sweep.arranged_candidates()
        assert len(asked) == points + points // 3


@pytest.mark.parametrize("seed", range(6))
def test_a_reused_materialized_micro_batch_is_a_fresh_one(seed):
    """``members`` takes a micro-batch an earlier split shared (same sequences, same packing) from its cache:
    what it returns equals a fresh search's, and the refinement of every split after it is unchanged."""
    rng = np.random.default_rng(200 + seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(9, 80)))
    warm = BatchSearch(lengths, COSTS, 8, SearchOptions())
    candidates = splits(warm)
    for split in candidates:
        cached = warm.members(split)
        fresh = BatchSearch(lengths, COSTS, 8, SearchOptions()).members(split)
        for (c_members, c_deg, c_loads), (f_members, f_deg, f_loads) in zip(cached, fresh):
            assert np.array_equal(c_deg, f_deg) and np.array_equal(c_loads, f_loads)
            assert all(np.array_equal(c, f) for c, f in zip(c_members, f_members))
        assert warm.refine_members(cached).time == BatchSearch(lengths, COSTS, 8, SearchOptions()).refine_members(
            fresh).time
    shared = sum(any(p is q for q in candidates[0].packings) for split in candidates[1:] for p in split.packings)
    if shared:                             # a micro-batch seen before is not materialised again
        assert len(warm._materialized) < sum(len(split.packings) for split in candidates)


def test_the_search_computes_each_sequences_seconds_once_and_the_same(monkeypatch):
    """``BatchSearch`` costs every sequence at every degree once (``DegreeCosts.all_seconds``) for the bucket
    means and the real times: bit for bit what ``mean_bucket_times`` alone and ``DegreeCosts.times`` give."""
    from solver.search import mean_bucket_times
    lengths = np.random.default_rng(5).integers(1, 800, size=500)
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    assert np.array_equal(mean_bucket_times(lengths, search.buckets, COSTS),
                          mean_bucket_times(lengths, search.buckets, COSTS, search.per_seq))
    assert np.array_equal(search.per_seq, COSTS.all_seconds(lengths))
    part = np.random.default_rng(6).permutation(len(lengths))[:170]   # a micro-batch's sequences, in group order
    local = search.bucket(lengths[part], 8)
    # read in place from the batch's rows (compiled) or gathered: numpy's bincount on the micro-batch, bit for bit
    bincount = np.stack([np.bincount(local.index, weights=row, minlength=len(local.upper))
                         for row in COSTS.all_seconds(lengths[part]).T], axis=1) / np.maximum(local.counts, 1)[:, None]
    from solver import kernels
    for compiled in (kernels.COMPILED, False):
        monkeypatch.setattr(kernels, "COMPILED", compiled)
        assert np.array_equal(mean_bucket_times(lengths[part], local, COSTS), bincount)
        assert np.array_equal(mean_bucket_times(lengths[part], local, COSTS, search.per_seq, part), bincount)
    real = COSTS.times(lengths)
    assert np.isinf(real).any()                                   # some sequences overflow small degrees
    assert np.array_equal(search.real_time, real.min(axis=1))
    assert np.array_equal(search.real_area, (real * np.asarray(COSTS.degrees)[None, :]).min(axis=1))


@pytest.mark.parametrize("seed", range(4))
def test_assign_from_counts_deals_each_buckets_sequences_longest_first(seed):
    """Micro-batch ``m`` gets ``counts[m, b]`` of bucket ``b``'s sequences, the earlier micro-batches the
    earlier ones in search order (longest first): what a mask over the batch per bucket gives."""
    rng = np.random.default_rng(300 + seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(20, 400)))
    search = BatchSearch(lengths, COSTS, 8, SearchOptions())
    split = search.first_split()
    counts = search.counts(split.assignment, len(split.packings))
    expected = np.empty(len(lengths), dtype=np.int64)
    for b in range(search.num_buckets):
        ids = search.order[search.buckets.index[search.order] == b]
        expected[ids] = np.repeat(np.arange(len(counts)), counts[:, b])
    assert np.array_equal(search.assign_from_counts(counts), expected)
    assert np.array_equal(np.bincount(expected, minlength=len(counts)), counts.sum(axis=1))


@pytest.mark.parametrize("seed", range(12))
def test_batchadas_estimate_is_a_lower_bound_and_pruning_keeps_its_plan(seed):
    """``batchada`` stops at the first degree whose ``_estimate`` reaches its best plan so far: each estimate
    is at most that degree's planned time, and the pruned search returns the plan of trying every degree."""
    from solver.baselines import _estimate, batchada, single_degree
    rng = np.random.default_rng(200 + seed)
    lengths = rng.integers(1, 800, size=int(rng.integers(2, 120)))
    times = {}
    for k, degree in enumerate(COSTS.degrees):
        if lengths.max() <= COSTS.capacity[k]:
            times[k] = single_degree(lengths, COSTS, 8, degree).time(lengths, COSTS)
            assert _estimate(lengths, COSTS, 8, k) <= times[k] * (1 + 1e-12)
    best = min(times.values())
    assert batchada(lengths, COSTS, 8).time(lengths, COSTS) == best


@pytest.mark.parametrize("seed", range(6))
def test_batchadas_estimate_bounds_non_nesting_degrees_with_tiles_too(seed):
    """Degrees 1, 2, 4 on nodes of 6 GPUs: a micro-batch holds the tiles of a degree (two 4s on 12 GPUs, not
    three), which ``_estimate`` divides by; the pruned search still returns the best single degree."""
    import flexsp
    from flexsp.plan.planner import solver_costs
    from flexsp.plan.token_budget import token_budget_cost
    from solver.baselines import _estimate, batchada, single_degree
    costs, _ = solver_costs(token_budget_cost(2, 64, 12, 512, 6), flexsp.Cluster(12, 6), (1, 2, 4))
    assert costs.tiles and costs.placeable is not None
    rng = np.random.default_rng(300 + seed)
    lengths = rng.integers(1, 500, size=int(rng.integers(2, 120)))
    times = {k: single_degree(lengths, costs, 12, d).time(lengths, costs) for k, d in enumerate(costs.degrees)}
    assert all(_estimate(lengths, costs, 12, k) <= t * (1 + 1e-12) for k, t in times.items())
    assert batchada(lengths, costs, 12).time(lengths, costs) == min(times.values())


@pytest.mark.parametrize("ring", [False, True])
def test_sequence_seconds_compiled_and_numpy_agree_bit_for_bit(monkeypatch, ring):
    """``sequence_seconds`` (every sequence at every degree, its least seconds and GPU-seconds where memory holds
    it): the compiled pass gives numpy's numbers exactly, including sequences that overflow small degrees."""
    from solver import kernels
    from solver.search import sequence_seconds
    costs = COSTS if not ring else DegreeCosts(COSTS.degrees, COSTS.quad, COSTS.lin, COSTS.capacity, COSTS.beta1,
                                               ring=tuple(3e-4 / d for d in COSTS.degrees),
                                               hops=tuple(1e-3 * d for d in COSTS.degrees))
    lengths = np.random.default_rng(8).integers(1, int(costs.capacity[-1]), size=700)
    real = costs.times(lengths)
    want = (costs.all_seconds(lengths), real.min(axis=1), (real * np.asarray(costs.degrees)).min(axis=1))
    assert np.isinf(real).any()
    for compiled in (kernels.COMPILED, False):
        monkeypatch.setattr(kernels, "COMPILED", compiled)
        for got, expected in zip(sequence_seconds(lengths, costs), want):
            assert np.array_equal(got, expected)


def test_group_max_is_numpys_maximum_at():
    """``kernels.group_max`` (the slowest sequence of each micro-batch, for ``real_bound``) against
    ``np.maximum.at`` from zeros, with micro-batches that hold nothing."""
    from solver import kernels
    rng = np.random.default_rng(9)
    owner = rng.choice([0, 2, 3, 6], size=1000)
    values = rng.random(1000)
    want = np.zeros(8)
    np.maximum.at(want, owner, values)
    assert np.array_equal(kernels.group_max(owner, values, 8), want)
