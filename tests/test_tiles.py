"""Tiles: the placement rule for SP groups of any degree, checked against brute force."""
import itertools

import numpy as np
import pytest

from flexsp.plan.cluster import (aligned_block, is_tile_start, nests, place_groups, tile_starts, tileable,
                                 ulysses_split)


def brute_fits(degrees, n, g):
    """Whether some choice of one tile per group leaves them disjoint (exhaustive)."""
    options = [[tuple(range(s, s + d)) for s in tile_starts(d, n, g)] for d in degrees]
    for pick in itertools.product(*options):
        used = [r for t in pick for r in t]
        if len(used) == len(set(used)):
            return True
    return False


@pytest.mark.parametrize("n,g", [(12, 6), (12, 12), (9, 3), (16, 8), (24, 8), (8, 8)])
def test_tiles_never_cross_nodes_and_validate(n, g):
    for d in range(1, n + 1):
        starts = tile_starts(d, n, g)
        assert bool(len(starts)) == tileable(d, n, g)
        for s in starts:
            ranks = range(s, s + d)
            assert ranks[-1] < n
            if d <= g:
                assert len({r // g for r in ranks}) == 1
            else:
                assert s % g == 0 and d % g == 0
        assert is_tile_start(starts, np.full(len(starts), d), n, g).all()
        others = np.setdiff1d(np.arange(n), starts)
        assert not is_tile_start(others, np.full(len(others), d), n, g).any()


def test_power_of_two_tiles_are_aligned_blocks():
    for d in (1, 2, 4, 8, 16, 32):
        assert [tuple(range(s, s + d)) for s in tile_starts(d, 32, 8)] == [aligned_block(k, d) for k in range(32 // d)]


@pytest.mark.parametrize("n,g,pool", [(12, 6, (1, 2, 3, 6, 12)), (12, 12, (1, 2, 3, 4, 6, 12)),
                                      (16, 8, (1, 2, 3, 4, 5, 8, 16)), (24, 8, (1, 2, 4, 8, 16, 24))])
def test_placement_is_valid_and_succeeds_for_nesting_sets(n, g, pool):
    for size in range(1, 6):
        for degrees in itertools.combinations_with_replacement(pool, size):
            starts = place_groups(degrees, n, g)
            if starts is not None:                       # whatever it returns is a valid placement
                used = [r for s, d in zip(starts, degrees) for r in range(s, s + d)]
                assert len(used) == len(set(used)) and max(used) < n
                assert is_tile_start(starts, np.array(degrees), n, g).all()
            else:
                assert sum(degrees) > n or not nests(degrees, n, g) or not all(tileable(d, n, g) for d in degrees)
            if nests(degrees, n, g) and sum(degrees) <= n:
                assert starts is not None
            if starts is None and sum(degrees) <= n and nests(degrees, n, g):
                pytest.fail("nesting set not placed")
            if starts is not None:
                assert brute_fits(degrees, n, g)


def test_nests():
    assert nests((1, 2, 4, 8, 16), 64, 8) and nests((1, 3, 6, 12), 12, 6) and nests((8, 24), 48, 8)
    assert not nests((2, 3), 12, 6) and not nests((1, 3), 16, 8) and not nests((16, 24), 48, 8)


def test_ulysses_split():
    assert ulysses_split(8, 32) == (8, 1) and ulysses_split(64, 32) == (32, 2)
    assert ulysses_split(6, 32) == (2, 3) and ulysses_split(24, 32) == (8, 3) and ulysses_split(3, 12) == (3, 1)
    assert ulysses_split(6, None) == (6, 1)
    for d in (1, 2, 4, 8, 16, 64, 128):
        for heads in (1, 2, 12, 32, 40):
            assert ulysses_split(d, heads)[0] == min(d, heads & -heads)
