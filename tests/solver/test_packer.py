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


@pytest.mark.parametrize("seed", range(30))
def test_compiled_packer_matches_the_interpreted_one_bit_for_bit(seed):
    """``kernels`` compiled (numba) and interpreted (its ``py_func``): the same classes, counts and
    makespan at every target, so a plan never depends on whether numba is installed."""
    from solver import kernels
    if not hasattr(kernels.best_packing, "py_func"):
        pytest.skip("numba not installed: only the interpreted packer runs")
    rng = np.random.default_rng(seed)
    lengths = np.unique(rng.integers(1, 800, size=rng.integers(1, 12))).astype(np.float64)
    packer = MicroBatchPacker(lengths, COSTS, num_gpus=int(rng.choice([4, 8, 64])))
    for _ in range(20):
        counts = rng.integers(0, 12, size=len(lengths)).astype(np.int64)
        for makespan, max_gpus, stretch, iters in ((np.inf, packer.num_gpus, False, 0), (np.inf, np.inf, True, 0),
                                                   (float(rng.uniform(0.05, 3.0)), np.inf, True, 0),
                                                   (np.inf, packer.num_gpus, False, 40)):
            args = (counts, makespan, packer.lower_bound(counts), 2e-3, iters, float(max_gpus), stretch, COSTS.beta1,
                    packer.num_gpus, None, *packer._kernel_args)
            compiled, interpreted = kernels.best_packing(*args), kernels.best_packing.py_func(*args)
            assert compiled[0] == interpreted[0]
            if compiled[0] >= 0:
                assert compiled[5] == interpreted[5]
                for a, b in zip(compiled[1:5], interpreted[1:5]):
                    assert np.array_equal(a, b)
            # the inner packing itself, interpreted line for line
            one = (counts, makespan - COSTS.beta1, float(max_gpus), stretch, *packer._kernel_args)
            compiled, interpreted = kernels.pack_classes(*one), kernels.pack_classes.py_func(*one)
            assert compiled[0] == interpreted[0]
            if compiled[0] >= 0:
                for a, b in zip(compiled[1:], interpreted[1:]):
                    assert np.array_equal(a, b)


NO_NUMBA = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "numba" or name.startswith("numba."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Blocked())
import json, numpy as np, flexsp
from flexsp.plan.token_budget import token_budget_cost
lengths = np.random.default_rng(3).integers(100, 3000, size=24)
plan = flexsp.plan_batch(lengths, token_budget_cost(4, 256, 8, 4096), flexsp.Cluster(8, 8), "flexsp", time_limit=60)
assert "numba" not in sys.modules
print(json.dumps([plan.predicted_time, [[(g.degree, sorted(map(int, g.seq_ids))) for g in mb.groups]
                                        for mb in plan.micro_batches]]))
"""


def test_a_plan_does_not_depend_on_whether_numba_is_installed():
    """Without numba the packer's loop runs interpreted (``kernels``'s fallback): the same plan."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    import flexsp
    from flexsp.plan.token_budget import token_budget_cost
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", NO_NUMBA], capture_output=True, text=True, timeout=300, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    lengths = np.random.default_rng(3).integers(100, 3000, size=24)
    plan = flexsp.plan_batch(lengths, token_budget_cost(4, 256, 8, 4096), flexsp.Cluster(8, 8), "flexsp",
                             time_limit=60)
    here = [plan.predicted_time, [[(g.degree, sorted(map(int, g.seq_ids))) for g in mb.groups]
                                  for mb in plan.micro_batches]]
    assert json.loads(out.stdout) == json.loads(json.dumps(here))


def test_the_kernels_compile_where_numba_cannot_cache_them():
    """A read-only install with no writable home: numba finds no cache directory and refuses ``cache=True``
    at decoration; the kernels then compile in the process instead of failing the import."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("numba")
    root = Path(__file__).resolve().parents[2]
    code = ("from solver import kernels\nkernels.warm()\n"
            "assert kernels.COMPILED and kernels.best_packing._cache.__class__.__name__ == 'NullCache'\nprint('ok')")
    env = {**os.environ, "PYTHONPATH": str(root), "NUMBA_CACHE_LOCATOR_CLASSES": "IPythonCacheLocator"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_group_with_room_for_more_than_an_int_still_packs_exactly():
    """A cost with (nearly) unbounded memory: the room a group has in sequences is clamped before it becomes an
    integer (numba's float-to-int conversion would wrap to -2^63)."""
    costs = DegreeCosts(degrees=(1, 2), quad=(1e-6, 5e-7), lin=(1e-3, 6e-4), capacity=(1e20, 2e20), beta1=0.05)
    lengths = np.array([10.0, 300.0])
    packer = MicroBatchPacker(lengths, costs, num_gpus=2)
    counts = np.array([3, 5])
    for packing in (packer.pack(counts, np.inf), packer.solve(counts)):
        assert (packing.counts >= 0).all() and (packing.total_counts() == counts).all()
        assert packing.makespan > costs.beta1


def test_nothing_to_pack_still_takes_beta1():
    packer = MicroBatchPacker(np.array([100.0]), COSTS, num_gpus=2)
    assert packer.pack(np.array([0]), COSTS.beta1 * 0.5) is None
    assert packer.pack(np.array([0]), 1.0).makespan == COSTS.beta1


def reference_classes(counts, target, max_gpus, stretch, order, lengths, times, held, charge, degrees, capacity,
                      stretched):
    """``kernels.pack_classes``' rule written plainly, for comparison: every bucket sorts the classes that may
    take it (slowest first, ties in creation order) afresh, where the kernel keeps one ranking up to date."""
    classes = []                                   # dicts in creation order
    gpus = 0
    for b in order:
        left = int(counts[b])
        if left == 0:
            continue
        budget = stretched[b] if stretch and stretched[b] > target else target
        k_new, best, per_new = -1, np.inf, 0
        for k in range(len(degrees)):
            if np.isfinite(times[b, k]):
                x = budget / times[b, k]
                per = held[b, k] if x >= held[b, k] else int(x)
                if per > 0 and ((left + per - 1) // per) * charge[k] < best:
                    k_new, best, per_new = k, ((left + per - 1) // per) * charge[k], per
        if k_new < 0:
            return None
        opened = sorted((c for c in classes if c["k"] >= k_new and c["mult"] > 0),
                        key=lambda c: (-c["time"], c["id"]))
        for c in opened:
            t = times[b, c["k"]]
            fit_f = min((max(budget, c["limit"]) - c["time"]) / t, (capacity[c["k"]] - c["tokens"]) / lengths[b])
            if fit_f < 1:
                continue
            fit = int(min(fit_f, 2.0 ** 52))
            if c["mult"] * fit > left:
                full, rest = left // fit, left % fit
                for mult, count in ((c["mult"] - full - (1 if rest else 0), 0), (1 if rest else 0, rest)):
                    if mult:
                        c["mult"] -= mult
                        new = dict(c, id=len(classes), mult=mult, counts=c["counts"].copy())
                        new["time"], new["tokens"] = c["time"] + count * t if count else c["time"], \
                            c["tokens"] + count * lengths[b] if count else c["tokens"]
                        new["counts"][b] += count
                        classes.append(new)
                if c["mult"]:
                    c["time"], c["tokens"] = c["time"] + fit * t, c["tokens"] + fit * lengths[b]
                    c["counts"][b] += fit
                left = 0
            else:
                c["time"], c["tokens"] = c["time"] + fit * t, c["tokens"] + fit * lengths[b]
                c["counts"][b] += fit
                left -= c["mult"] * fit
            if left <= 0:
                break
        if left > 0:
            gpus += ((left + per_new - 1) // per_new) * degrees[k_new]
            if gpus > max_gpus:
                return None
            for mult, count in ((left // per_new, per_new), (1 if left % per_new else 0, left % per_new)):
                if mult:
                    row = np.zeros(len(lengths), np.int64)
                    row[b] = count
                    classes.append(dict(id=len(classes), k=k_new, mult=mult, limit=budget, time=count * times[b, k_new],
                                        tokens=count * lengths[b], counts=row))
    return [c for c in classes if c["mult"] > 0]


@pytest.mark.parametrize("seed", range(12))
def test_packer_ranks_classes_as_a_fresh_sort_per_bucket_would(seed):
    """The kernel keeps the classes ranked (slowest first, ties in creation order) across buckets instead of
    sorting them per bucket (4x faster on a 340-bucket micro-batch): the same classes as sorting afresh, on
    hundreds of buckets and with times rounded to force ties."""
    from solver import kernels
    rng = np.random.default_rng(seed)
    num_buckets = int(rng.choice([5, 40, 300]))
    lengths = np.sort(rng.choice(np.arange(1, 800), size=num_buckets, replace=False))[::-1].astype(np.float64)
    times = COSTS.times(lengths) * rng.uniform(0.9, 1.0, size=(num_buckets, len(COSTS.degrees)))
    if seed % 2:
        times = np.round(times, 2) + 0.01           # equal times: the tie order matters
    packer = MicroBatchPacker(lengths, COSTS, num_gpus=int(rng.choice([8, 64, 1024])), bucket_times=times)
    for _ in range(10):
        counts = rng.integers(0, 30, size=num_buckets).astype(np.int64)
        target = float(rng.uniform(0.02, 3.0))
        for max_gpus, stretch in ((float(packer.num_gpus), False), (np.inf, True)):
            args = (counts, target, max_gpus, stretch, *packer._kernel_args)
            got, want = kernels.pack_classes(*args), reference_classes(*args)
            assert (got[0] < 0) == (want is None)
            if want is not None:
                assert got[0] == len(want)
                assert np.array_equal(got[1], [c["k"] for c in want])
                assert np.array_equal(got[2], [c["mult"] for c in want])
                assert np.array_equal(got[3], [c["time"] for c in want])
                assert np.array_equal(got[4].reshape(len(want), -1), np.array([c["counts"] for c in want]).reshape(len(want), -1))
