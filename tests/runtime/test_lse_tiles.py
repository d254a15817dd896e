"""The explicit lse form (the ring's kernel for windows, chunks and softcaps where varlen cannot run) works
on query-row tiles, each against the band of keys its rows can reach: the same numbers as one untiled,
unbanded pass, no score matrix above the tile's bytes, and a window's work about rows x window."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.kernels import Features  # noqa: E402
from flexsp.runtime.kernels import sdpa  # noqa: E402
from flexsp.runtime.kernels.layout import LseSpec  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 8
BOUNDS_Q = (0, 7, 7, 20, 23)          # a sequence without queries, one with 13 rows, padding after
BOUNDS_K = (0, 9, 12, 25, 28)


def _spec(features: Features | None, positions: bool, causal: bool = True) -> LseSpec:
    cu_q, cu_k = torch.tensor(BOUNDS_Q, dtype=torch.int32), torch.tensor(BOUNDS_K, dtype=torch.int32)
    pos_q = pos_k = None
    if positions:   # zigzag-like blocks: ascending positions per sequence, in two runs with a gap
        pos_q = torch.cat([torch.arange(30, 37), torch.arange(40, 46), torch.arange(60, 67), torch.arange(3)])
        pos_k = torch.cat([torch.arange(20, 29), torch.arange(5, 8), torch.arange(34, 41), torch.arange(55, 61),
                           torch.arange(3)])
    return LseSpec(cu_q, cu_k, 13, 13, causal, 0.3, "sdpa", BOUNDS_Q, BOUNDS_K, features=features,
                   pos_q=pos_q, pos_k=pos_k, host_pos_q=None if pos_q is None else pos_q.numpy(),
                   host_pos_k=None if pos_k is None else pos_k.numpy())


def _tensors():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(25, HEADS, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(28, KV_HEADS, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(25, HEADS, DIM, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _run(spec: LseSpec, monkeypatch, tile_bytes: int):
    monkeypatch.setattr(sdpa, "TILE_BYTES", tile_bytes)
    q, k, v, dout = _tensors()
    out, lse = sdpa.each_forward(q, k, v, spec)
    grads = sdpa.each_backward(dout, q, k, v, out, lse, spec, None)
    return out, lse, grads


CASES = [(Features(window=3), False), (Features(chunk=4, softcap=1.5), False), (Features(window=5, softcap=2.0), True),
         (Features(window=2, chunk=5), True), (None, True)]


@pytest.mark.parametrize("features,positions", CASES)
def test_tiles_give_the_untiled_numbers(features, positions, monkeypatch):
    spec = _spec(features, positions)
    with monkeypatch.context() as unbanded:
        unbanded.setattr(sdpa, "host_positions", lambda spec, seq: None)    # every key, one tile: the old form
        whole = _run(spec, unbanded, 1 << 40)
    row_bytes = HEADS * 13 * 4 * sdpa._TEMPORARIES
    for tile_rows in (1, 2, 5):
        tiled = _run(spec, monkeypatch, tile_rows * row_bytes)
        torch.testing.assert_close(tiled[0], whole[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(tiled[1], whole[1], rtol=0, atol=1e-12)
        for got, want in zip(tiled[2], whole[2]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_no_score_matrix_above_the_tile(monkeypatch):
    """The memory contract, counted: no explicit score matrix (and its temporaries) above the tile's bytes
    (before, a 13-row sequence built all 13 rows at once; a ring block of a long context builds lq x lk)."""
    seen_rows, seen_bytes = [], []
    explicit = sdpa._explicit_scores

    def counting(*args):
        scores, dcap = explicit(*args)
        seen_rows.append(scores.shape[1])
        seen_bytes.append(scores.numel() * 4 * sdpa._TEMPORARIES)
        return scores, dcap

    monkeypatch.setattr(sdpa, "_explicit_scores", counting)
    budget = 2 * HEADS * 13 * 4 * sdpa._TEMPORARIES       # two rows of the longest key range
    _run(_spec(Features(window=3), False), monkeypatch, budget)
    assert max(seen_bytes) <= budget and max(seen_rows) < 13
    assert sum(seen_rows) == 2 * (7 + 13 + 3)     # every query row once forward and once backward


def test_tiles_cover_every_row_once():
    for lq, lk, budget in ((1, 1, 1), (13, 9, 10_000), (100, 7, 3 * HEADS * 7 * 4 * sdpa._TEMPORARIES)):
        tiles = sdpa.row_tiles((5, 5 + lq, 0, lk), HEADS, budget)
        assert tiles[0][0] == 5 and tiles[-1][1] == 5 + lq
        assert all(a < b and b == c for (a, b), (c, _) in zip(tiles, tiles[1:]))
    assert len(sdpa.row_tiles((0, 100, 0, 7), HEADS, 3 * HEADS * 7 * 4 * sdpa._TEMPORARIES)) == 34


def test_a_window_computes_only_its_band(monkeypatch):
    """Bottom-right and zigzag positions alike: every score matrix of a window-3 layer has at most
    rows + 3 keys (before the band: every key of the sequence), and the banded keys are all it needs."""
    explicit = sdpa._explicit_scores
    for positions in (False, True):
        shapes = []

        def counting(*args):
            scores, dcap = explicit(*args)
            shapes.append(scores.shape[1:])
            return scores, dcap

        monkeypatch.setattr(sdpa, "_explicit_scores", counting)
        _run(_spec(Features(window=3), positions), monkeypatch, 2 * HEADS * 13 * 4 * sdpa._TEMPORARIES)
        assert shapes and all(keys <= rows + 3 for rows, keys in shapes)
        assert max(keys for _, keys in shapes) < 13


def test_unsorted_or_device_only_positions_fall_back_to_every_key():
    spec = _spec(Features(window=3), True)
    seq = (7, 20, 12, 25)
    assert sdpa.host_positions(spec, seq) is not None
    for broken in ({"host_pos_q": None}, {"host_pos_k": spec.host_pos_k[::-1].copy()}):
        fields = {**spec.__dict__, **broken}
        assert sdpa.host_positions(LseSpec(**fields), seq) is None
        assert sdpa.key_band(LseSpec(**fields), seq, (7, 9), None) == (12, 25)
